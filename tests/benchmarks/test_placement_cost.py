"""benchmarks/placement_cost.py: what it times is a whole P/D placement, and its table reads the JSON."""
from __future__ import annotations

from benchmarks import placement_cost
from benchmarks.placement_cost import ROOT, Fleet


def test_a_placement_picks_a_decode_worker_and_records_the_send():
    fleet = Fleet(6)
    prompt = list(range(200))
    decode_ids = {w.worker_id for w in fleet.registry.states() if w.info.role == "decode"}
    assert len(decode_ids) == 3
    fleet.place("r0", prompt)
    holders = [wid for wid in decode_ids if fleet.registry.index.matched_blocks(wid, _hashes(fleet, prompt))]
    assert len(holders) == 1                              # the chosen decode worker now holds the prompt


def _hashes(fleet: Fleet, prompt: list[int]) -> list[int]:
    from shared.hashing import block_hashes
    info = next(iter(fleet.registry.static.values()))
    return block_hashes(prompt, info.block_size, info.hash_root)


def test_each_tree_is_timed_in_its_own_process_and_the_table_reads_the_json(tmp_path):
    doc = placement_cost.measure({"ours": ROOT, "baseline": ROOT}, [2, 8], slices=3, seconds=0.05)
    for name in ("ours", "baseline"):
        for size in ("2", "8"):
            assert len(doc["runs"][name][size]) == 3
            cell = doc["median"][name][size]
            assert cell["placement_us"] > cell["states_us"] > 0
    lines = placement_cost.table(doc).splitlines()
    assert len(lines) == 4 and lines[2].startswith("| 2 | ") and lines[3].endswith("x |")
    out = tmp_path / "pc.json"
    assert placement_cost.main(["--workers", "2", "--slices", "1", "--seconds", "0.05", "--output", str(out)]) == 0
    assert out.is_file() and "| 2 |" in out.with_suffix(".md").read_text()
