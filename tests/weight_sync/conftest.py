"""The weight-sync tests' shared sender: a dist sender on an ephemeral local port, small
buckets so a transfer spans several."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from areal_like.core.config import DistWeightSyncConfig
from weight_sync import DistWeightSender

TIMEOUT_S = 2.0


@pytest.fixture
def sender() -> Iterator[DistWeightSender]:
    s = DistWeightSender(
        DistWeightSyncConfig(type="dist", bucket_mb=0.01, timeout_s=TIMEOUT_S, store_addr="127.0.0.1:0")
    )
    yield s
    s.close()
