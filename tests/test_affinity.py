"""Cores per pool: CPU lists, the split between pools on one host, and pinning a process."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from services.affinity import format_cpus, parse_cpus, split_cores
from services.config import load_config
from services.launcher import with_local_core_split


def test_cpu_lists_parse_and_refuse_by_name():
    assert parse_cpus("0-3,8, 5") == [0, 1, 2, 3, 5, 8]
    assert format_cpus([0, 1, 5]) == "0,1,5"
    with pytest.raises(ValueError, match="'x'"):
        parse_cpus("0,x")
    with pytest.raises(ValueError, match="increasing"):
        parse_cpus("3-1")
    with pytest.raises(ValueError, match=r"cpus|CPU list"):
        load_config(None, {"decode": {"cpus": "1-0"}}, environ={})


def test_split_is_disjoint_and_proportional():
    assert split_cores([0, 1], 1, 1) == ([0], [1])
    assert split_cores(list(range(8)), 3, 1) == ([0, 1, 2, 3, 4, 5], [6, 7])
    assert split_cores(list(range(8)), 1, 30) == ([0], [1, 2, 3, 4, 5, 6, 7])
    assert split_cores([4], 1, 1) == ([4], [4])  # one core: nothing to split


def test_local_cluster_splits_cores_unless_told():
    cfg = with_local_core_split(load_config(environ={}))
    pre, dec = parse_cpus(cfg.prefill.cpus), parse_cpus(cfg.decode.cpus)
    assert sorted(pre + dec) == sorted(os.sched_getaffinity(0)) or len(os.sched_getaffinity(0)) < 2
    assert not set(pre) & set(dec) or len(os.sched_getaffinity(0)) < 2
    given = load_config(None, {"decode": {"cpus": "0"}}, environ={})
    assert with_local_core_split(given) == given  # an operator's choice is kept
    colocated = load_config(None, {"mode": "colocated"}, environ={})
    assert with_local_core_split(colocated) == colocated


def test_pinning_restricts_the_process():
    cpu = min(os.sched_getaffinity(0))
    code = (
        "import os; from services.affinity import pin_current_process; "
        f"n = pin_current_process([{cpu}], 4); print(n, sorted(os.sched_getaffinity(0)))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", f"[{cpu}]"]  # one core: one torch thread
