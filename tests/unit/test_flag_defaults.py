"""core/flag_defaults.py repeats values whose owners import torch (so that `wcache serve`'s front parses
its flags without torch): each must equal its owner's."""

from wcache.core import config, ranks
from wcache.core import flag_defaults as defaults
from wcache.engine.worker import runner
from wcache.model import quant


def test_each_default_is_its_owners():
    assert defaults.DTYPE_CHOICES == config.DTYPE_CHOICES
    assert defaults.QUANTIZATION_CHOICES == quant.CHOICES
    assert defaults.DEFAULT_MAX_NUM_SEQS == runner.DEFAULT_MAX_NUM_SEQS
    assert defaults.DEFAULT_MAX_WAITING_REQUESTS == runner.DEFAULT_MAX_WAITING_REQUESTS
    assert (defaults.DEFAULT_MASTER_ADDR, defaults.DEFAULT_MASTER_PORT) == (ranks.DEFAULT_MASTER_ADDR,
                                                                            ranks.DEFAULT_MASTER_PORT)
