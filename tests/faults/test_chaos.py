"""The fault-injection campaign of issue 15 (tests/support/chaos.py), short and seeded for CI.

Random kills of sources and destinations (replacements join), stalls (SIGSTOP) shorter and longer than
the push timeout, NIC cuts and restores between two network namespaces (when this machine can make
them), abandoned pushes and the re-plans they cause, with a staged and an inplace reader checking every
version they see against per-version digests. No mixed or wrong version, no hang, no broken expectation.
"""

from __future__ import annotations

import json

import numpy as np

from tests.support.chaos import (
    FAULT_KINDS,
    SHAPES,
    Campaign,
    Config,
    Expected,
    netns_unavailable,
    version_tensor,
)


def test_checker_tells_exact_mixed_and_wrong_versions_apart() -> None:
    """The readers' check itself: bitwise equal passes, bytes of two versions are "mixed", bytes of no
    version (NaN, never written; a flipped bit) are "wrong"."""
    exp = Expected()
    model = {k: version_tensor(k, 7) for k in SHAPES}
    assert exp.check(model, 7) == ("ok", "")
    assert exp.check(model, 6)[0] == "mixed"  # all of 7 read as 6: still bytes of a version, not 6's
    torn = {k: v.copy() for k, v in model.items()}
    torn["emb"][100:] = version_tensor("emb", 6)[100:]
    verdict, detail = exp.check(torn, 7)
    assert verdict == "mixed" and "[6, 7]" in detail, detail
    unwritten = {k: v.copy() for k, v in model.items()}
    unwritten["w"][3:5] = np.nan
    assert exp.check(unwritten, 7)[0] == "wrong"
    flipped = {k: v.copy() for k, v in model.items()}
    flipped["norm"].view(np.int32)[5] ^= 1  # one bit: equal as floats to nothing, caught bytewise
    assert exp.check(flipped, 7)[0] == "wrong"
    assert np.all(version_tensor("emb", 0) != 0)
    assert np.array_equal(version_tensor("w", 3), version_tensor("w", 3))  # reproducible in any process


def test_chaos_campaign_sees_no_torn_version_and_no_hang(ray_cluster) -> None:
    netns = netns_unavailable() is None
    cfg = Config(pushes=14, seed=15, netns=netns, push_timeout=4.0, dest_push_timeout=4.0, stall_short=1.0,
                 stall_long=6.0, nic_down=2.5, hang_margin=45.0, log=print)
    summary = Campaign(cfg, name="chaos-ci").run()
    print("CHAOS_SUMMARY " + json.dumps(summary, sort_keys=True))
    wanted = {k for k in FAULT_KINDS if k != "none" and (netns or k != "nic_cut")}
    assert wanted <= {k for k, n in summary["faults"].items() if n > 0}, summary["faults"]
    checked = summary["versions_checked"]
    assert checked.get("staged", 0) > 0 and checked.get("inplace", 0) > 0, checked
    assert summary["hangs"] == 0, summary
    assert summary["mixed"] == 0, summary["samples"]
    assert summary["wrong"] == 0, summary["samples"]
    assert summary["expectation_failures"] == 0, summary["expectation_samples"]
