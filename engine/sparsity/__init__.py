"""2:4 structured sparsity (issue #41): the checkpoint format, one-shot pruning, and the engine's sparse weights.

Modules (role, owner):
- `format.py`: the tidepool-2:4 layout, the one source of truth: `pack_2to4(dense, mask=None, name)`
  -> (values, meta); `unpack_2to4(values, meta, in_features, scales=None, name)` -> dense;
  `validate(name, values, meta, in_features=None, scales=None)`; `kept_mask(meta, in_features)`;
  `read_sparsity_config(config_dict)`; `densify_tensors(state_dict)`; constants ``CONFIG_KEY``,
  ``FORMAT``, ``KEY_*``, ``*_SUFFIX``. (SPARSIFY)
- `calibration.py` (text: CPython's ``pydoc_data.topics``, even half; the odd half is held out),
  `wanda.py` (magnitude and Wanda masks), `sparsegpt.py` (OBS update), `sequential.py` (layer-by-layer
  driver over a transformers model), `prune.py`, `cli.py` (`tidepool sparsify`). (SPARSIFY)
  `prune.sparsify_folder(src, dst, method, values_dtype=None, calibration="pydoc", num_samples=64,
  seq_len=256) -> Path` writes a sparse folder; `prune.cached_sparse_checkpoint(src, method,
  values_dtype="float32") -> Path` returns (building once) the pruned copy of `src` under
  ``$TIDEPOOL_CACHE/sparse/<src name>-<hash>/<method>-<values_dtype>[-n64-l256]/`` for the exactness
  tests and benches (int8 entries are converted from the float32 one); `prune.densify_folder(sparse,
  dst)` writes the dense equivalent that transformers loads.
- `weight.py`, `load.py`, `cuda*.py`: the runtime sparse linear weights and the loader. (SPARSE-ENGINE)

Invariants: nothing here but `format.py` knows the tensor layout; pruning only writes through it.
"""
