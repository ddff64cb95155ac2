"""Maps the repository's folders onto the `tidepool` package.

Each folder in ROOTS becomes that subpackage (`engine/` -> `tidepool.engine`, `contract/` ->
`tidepool.contract`, ...); `cli/` holds the top-level `tidepool` package (version and console script).
A folder named `operator` must never be importable as a top-level name: it would shadow the
standard library's `operator` module, hence the mapping instead of a flat layout.
"""

from setuptools import find_packages, setup

ROOTS = {
    "tidepool": "cli",
    "tidepool.contract": "contract",
    "tidepool.common": "common",
    "tidepool.engine": "engine",
    "tidepool.router": "router",
    "tidepool.operator": "operator",
    "tidepool.kernels": "kernels",
}

packages: list[str] = []
package_dir: dict[str, str] = {}
for package, folder in ROOTS.items():
    package_dir[package] = folder
    packages.append(package)
    for sub in find_packages(folder):
        packages.append(f"{package}.{sub}")
        package_dir[f"{package}.{sub}"] = f"{folder}/{sub.replace('.', '/')}"

# The CPU ops are compiled on the target machine from their C++ sources, so the sources ship.
package_data = {"tidepool.engine": ["py.typed"], "tidepool.engine.cpu_ops": ["*.cpp", "*.h"]}
setup(packages=packages, package_dir=package_dir, package_data=package_data)
