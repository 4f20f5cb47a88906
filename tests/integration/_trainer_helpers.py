"""The old name of tests/helpers/trainer.py, kept only while tests/unit/test_families.py imports it by this
name (after its own sys.path insert); delete this file once that line reads `from helpers.trainer import`."""
from helpers.trainer import examples, fp8_hf_names, publish_batches, synthetic_batch, tiny_cfg  # noqa: F401
