"""``tools/compare_results.py``'s job list: names that hold commas are taken whole."""
from __future__ import annotations

from tools.compare_results import JOBS, job_names


def test_a_job_list_keeps_names_with_commas_whole_and_leaves_unknown_names_for_the_error():
    text = "default,jpeg augment, 0 input workers,image folder, augment, no image cache, 0 input workers,async,nope"
    assert job_names(text) == ["default", "jpeg augment, 0 input workers",
                               "image folder, augment, no image cache, 0 input workers", "async", "nope"]
    assert job_names(",".join(JOBS)) == list(JOBS)


def test_the_digest_without_a_prefix_sees_every_other_array_and_ignores_only_that_prefix(tmp_path):
    import numpy as np

    from tools.compare_results import digest

    a, b, c = tmp_path / "a.npz", tmp_path / "b.npz", tmp_path / "c.npz"
    w = np.arange(6, dtype=np.float32)
    np.savez(a, **{"params/w": w, "ema/w": w, "step": np.int64(3)})
    np.savez(b, **{"params/w": w, "ema/w": w + 1, "step": np.int64(3)})  # only the EMA moved
    np.savez(c, **{"params/w": w.reshape(2, 3), "ema/w": w, "step": np.int64(3)})  # same bytes, other shape
    assert digest(str(a)) != digest(str(b))
    assert digest(str(a), ("ema/",)) == digest(str(b), ("ema/",))
    assert digest(str(a), ("ema/",)) != digest(str(c), ("ema/",))
