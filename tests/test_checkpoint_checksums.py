"""Content checksums of resume checkpoints: who hashes what, and what a changed byte is called."""

from __future__ import annotations

import itertools
import json
import random

import pytest

from lctrain.checksums import file_checksums
from lctrain.train import checkpoint as ckpt


def _best_max_load(sizes: dict[str, int], world: int) -> int:
    """The smallest largest share over every assignment of the files to `world` ranks (brute force)."""
    best = sum(sizes.values())
    for owners in itertools.product(range(world), repeat=len(sizes)):
        loads = [0] * world
        for owner, size in zip(owners, sizes.values()):
            loads[owner] += size
        best = min(best, max(loads))
    return best


@pytest.mark.parametrize("seed", range(20))
def test_each_file_is_hashed_by_one_rank_and_no_rank_reads_much_more_than_it_must(seed):
    rng = random.Random(seed)
    world = rng.randint(1, 4)
    sizes = {f"f{i}.pt": rng.choice([1, 10, 100, 1000]) * rng.randint(1, 9) for i in range(rng.randint(1, 7))}
    shares = ckpt.hash_shares(sizes, world)
    assert len(shares) == world
    assert sorted(n for share in shares for n in share) == sorted(sizes)
    largest = max(sum(sizes[n] for n in share) for share in shares)
    assert largest <= 4 / 3 * _best_max_load(sizes, world)  # largest-first to the least loaded: Graham's bound


def test_the_whole_model_file_is_a_share_of_its_own():
    sizes = {"mp_rank_00_model_states.pt": 100, "rng_rank0.pt": 1, "rng_rank1.pt": 1}
    sizes |= {f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt": 40 for r in range(2)}
    assert ckpt.hash_shares(sizes, 2) == [
        ["mp_rank_00_model_states.pt"],
        ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
        + ["rng_rank0.pt", "rng_rank1.pt"],
    ]
    assert ckpt.hash_shares(sizes, 1) == [sorted(sizes, key=lambda n: (-sizes[n], n))]


def _checkpoint(tmp_path, files: dict[str, bytes]):
    path = tmp_path / "step_2"
    path.mkdir()
    for name, data in files.items():
        (path / name).write_bytes(data)
    sizes = {n: len(d) for n, d in files.items()}
    checksums = {n: file_checksums(path / n)[0] for n in files}
    state = {"step": 2, "files": sizes, "checksums": checksums}
    (path / ckpt.STATE_FILE).write_text(json.dumps(state))
    return path, state


def test_a_changed_byte_or_another_checkpoints_file_of_the_same_size_is_named(tmp_path):
    path, state = _checkpoint(tmp_path, {"a.pt": bytes(range(256)) * 64, "b.pt": b"b" * 1000})
    assert ckpt.changed_file(path, state) == "" and ckpt.changed_on_disk(path) == ""
    data = bytearray((path / "b.pt").read_bytes())
    data[500] ^= 1
    (path / "b.pt").write_bytes(data)
    why = "b.pt holds other bytes than it was written with: its xxh3-128 checksum differs"
    assert ckpt.changed_file(path, state) == why
    assert ckpt.changed_on_disk(path) == why  # one process: it hashes every file
    assert ckpt.changed_file(path, state, ["a.pt"]) == ""  # what an export reads, only
    (path / "a.pt").write_bytes(bytes(reversed(range(256))) * 64)  # the same size and structure, other bytes
    assert ckpt.changed_files(path, state["checksums"], ["a.pt", "b.pt"]) == ["a.pt", "b.pt"]
    assert ckpt.changed_on_disk(path).startswith("a.pt holds other bytes")  # the first, on every rank


def test_a_checkpoint_written_before_checksums_were_kept_is_not_called_changed(tmp_path):
    path, state = _checkpoint(tmp_path, {"a.pt": b"a" * 100})
    (path / "a.pt").write_bytes(b"c" * 100)
    del state["checksums"]
    (path / ckpt.STATE_FILE).write_text(json.dumps(state))
    assert ckpt.changed_file(path, state) == "" and ckpt.changed_on_disk(path) == ""
    (path / ckpt.STATE_FILE).write_text("")  # an unreadable state: its reader says why, not this
    assert ckpt.changed_on_disk(path) == ""
