#  Copyright (c) Microsoft Corporation.
#  Licensed under the MIT License.
#
#  From microsoft/nnscaler's tests/utils.py (commit 1585c15): only the helpers the vendored tests
#  use, unchanged (init_random without its CUDA seeding, which is a no-op on CPU). Left out: the
#  helpers that mock nnScaler's runtime or load its generated modules (mock_*, new_empty,
#  replace_all_device_with), which only the tests listed as not applicable in docs/nnscaler.md use.
"""nnScaler's test helpers used by the vendored tests."""

import functools
import logging
import re
import shutil
from contextlib import contextmanager
from io import StringIO
from typing import Optional, Pattern, Union

import numpy as np
import torch


def init_random(seed: int = 1):
    np.random.seed(seed)
    torch.manual_seed(seed)


def retry(*exceptions, max_tries=3, match: Optional[Union[str, Pattern[str]]] = None, delay=5):
    exceptions = exceptions or (Exception,)
    def decorator(func):
        @functools.wraps(func)
        def wrapper(*args, **kwargs):
            for i in range(max_tries):
                try:
                    return func(*args, **kwargs)
                except exceptions as e:
                    matched = not match or re.search(match, str(e))
                    if i == max_tries - 1 or not matched:
                        raise
                    from time import sleep
                    sleep(delay)
        return wrapper
    return decorator


@contextmanager
def catch_log(_logger, loglevel='DEBUG'):
    string_stream = StringIO()
    old = _logger.level
    _logger.setLevel(loglevel)
    handler = logging.StreamHandler(string_stream)
    handler.setLevel(loglevel)
    _logger.addHandler(handler)
    yield string_stream
    _logger.removeHandler(handler)
    _logger.setLevel(old)


@contextmanager
def clear_dir_on_rank0(tempdir):
    if torch.distributed.get_rank() == 0 and tempdir.exists():
        shutil.rmtree(tempdir)
    yield tempdir
    torch.distributed.barrier()
    if torch.distributed.get_rank() == 0 and tempdir.exists():
        shutil.rmtree(tempdir)


@contextmanager
def raises_with_cause(exception_type, match=None):
    try:
        yield
    except Exception as e:
        cause = e
        while cause.__cause__:
            cause = cause.__cause__
        assert isinstance(cause, exception_type), f"unexpected cause: {cause}"
        assert not match or re.search(match, str(cause)), f"unexpected cause message: {cause}"
    else:
        raise AssertionError(f"expected exception {exception_type} not raised")
