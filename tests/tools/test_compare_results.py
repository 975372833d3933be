"""``tools/compare_results.py``'s job list: names that hold commas are taken whole."""
from __future__ import annotations

from tools.compare_results import JOBS, job_names


def test_a_job_list_keeps_names_with_commas_whole_and_leaves_unknown_names_for_the_error():
    text = "default,jpeg augment, 0 input workers,image folder, augment, no image cache, 0 input workers,async,nope"
    assert job_names(text) == ["default", "jpeg augment, 0 input workers",
                               "image folder, augment, no image cache, 0 input workers", "async", "nope"]
    assert job_names(",".join(JOBS)) == list(JOBS)
