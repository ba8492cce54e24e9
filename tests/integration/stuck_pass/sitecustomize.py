"""A forward pass stuck while its process runs, for tests/integration/test_respawn.py: on the path
of a `wcache serve --respawn` started with ``WCACHE_TEST_STUCK_FILE``, every engine worker's
``RankRunner.forward`` waits while that file exists (sleeping, so the worker's other threads, its
heartbeat's included, go on). Python imports this module at start-up (``site``); without the
variable it does nothing. Not part of wcache: only that test puts this directory on the path."""

import importlib.abc
import importlib.util
import os
import sys
import time

_TRIGGER = os.environ.get("WCACHE_TEST_STUCK_FILE")


def _patch(module) -> None:
    forward = module.RankRunner.forward

    def stuck_while_the_file_exists(self, *args, **kwargs):
        while os.path.exists(_TRIGGER):
            time.sleep(0.01)
        return forward(self, *args, **kwargs)

    module.RankRunner.forward = stuck_while_the_file_exists


class _PatchRunner(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name != "wcache.engine.worker.runner":
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run_module = spec.loader.exec_module

        def exec_module(module):
            run_module(module)
            _patch(module)

        spec.loader.exec_module = exec_module
        return spec


if _TRIGGER:
    sys.meta_path.insert(0, _PatchRunner())
