"""LoRA test fixtures: three PEFT adapters of different ranks, targets and scalings on the tiny model.

- "qv": r=8 on q_proj/v_proj, v_proj's rank 4 through rank_pattern (lora_alpha 16);
- "all": r=4 on all seven projections, rsLoRA scaling (lora_alpha 8);
- "mlp": r=16 on o_proj and the MLP, down_proj's alpha 32 through alpha_pattern (lora_alpha 16).
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lora_helpers import AdapterSpec, make_adapter

ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECS = {
    "qv": AdapterSpec(8, ("q_proj", "v_proj"), rank_pattern={"v_proj": 4}),
    "all": AdapterSpec(4, ALL, alpha=8.0, use_rslora=True),
    "mlp": AdapterSpec(16, ("o_proj", "gate_proj", "up_proj", "down_proj"), alpha_pattern={"down_proj": 32.0}),
}


@pytest.fixture(scope="session")
def lora_adapters(
    tmp_path_factory: pytest.TempPathFactory, tiny_model_dir: Path
) -> dict[str, tuple[Path, torch.nn.Module]]:
    """name -> (adapter folder, the PEFT model it was saved from)."""
    root = tmp_path_factory.mktemp("lora")
    return {
        name: (root / name, make_adapter(tiny_model_dir, root / name, spec, seed))
        for seed, (name, spec) in enumerate(SPECS.items(), start=1)
    }
