"""The choices and defaults `wcache serve`'s flags show, without torch.

Their owners (core/config.py, model/quant.py, engine/worker/runner.py, core/ranks.py) are modules the
front need not load (runner.py imports torch; the others, the engine's configuration), and `wcache serve`'s
front process parses its flags without them (engine/api_server/core_client.py): the values are
written here once more, and tests/unit/test_flag_defaults.py proves each equals its owner's.
"""

from __future__ import annotations

DTYPE_CHOICES = ["auto", "bfloat16", "float16", "float32"]  # core/config.py
# model/quant.py's CHOICES: the methods it runs and the upstream ones it refuses with their reason.
QUANTIZATION_CHOICES = ["awq", "compressed-tensors", "fp8", "gptq", "int8", "modelopt", "modelopt_fp4", "mxfp4",
                        "none"]
DEFAULT_MAX_NUM_SEQS = 256  # engine/worker/runner.py
DEFAULT_MAX_WAITING_REQUESTS = 128  # engine/worker/runner.py
DEFAULT_MASTER_ADDR = "127.0.0.1"  # core/ranks.py
DEFAULT_MASTER_PORT = 29501  # core/ranks.py
