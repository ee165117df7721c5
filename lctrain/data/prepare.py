"""`lctrain prepare`: read a corpus, tokenize it on all cores, pack it into windows, write the packed store.

The pipeline is a stream with bounded memory whatever the token budget:

    source batches -> workers (parse, tokenize; results in submission order) -> skip/filter -> shuffle buffer
    -> mixture -> packer (-> interleaved chunks within each window) -> Arrow shards

Everything after the workers runs in this process with seeded generators, so the output is byte-identical for a
given config whatever the number of workers. The dataset is built in a hidden sibling directory and renamed into
place only when complete; an interrupted run leaves no directory that looks complete, and the next run resumes it
from its last complete shard (`lctrain.data.progress`).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import re
import shutil
import time
from collections import Counter, deque
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from rich.progress import BarColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lctrain import __version__
from lctrain.checksums import file_checksums
from lctrain.config import (
    DOMAINS,
    Config,
    config_fingerprint,
    data_dir,
    data_fingerprint,
    reread_warning,
    write_resolved,
)
from lctrain.console import message_console, plain_console
from lctrain.data import encode
from lctrain.data.manifest import Newer
from lctrain.data.mixture import (
    SHARE_TOLERANCE,
    Mixture,
    SourceShares,
    keyed_by_domain,
    normalized,
    share_misses,
)
from lctrain.data.packing import Packer, ShuffleBuffer
from lctrain.data.pool import WorkerDied, WorkerStartFailed, imap_ordered
from lctrain.data.progress import Partial
from lctrain.data.sources import (
    LocalFiles,
    SourceStream,
    describe_source,
    hub_batches,
    local_batches,
    mixed_batches,
    resolve_local_files,
    synthetic_batches,
)
from lctrain.data.stats import DatasetStats, render
from lctrain.data.store import (
    FORMAT_VERSION,
    MANIFEST,
    Manifest,
    ShardWriter,
    dataset_problem,
    token_dtype,
    write_manifest,
)
from lctrain.errors import UserError, first_and_more, is_environment_error, writing
from lctrain.hardware import usable_cpus
from lctrain.lifetime import death_of, is_alive, refuse_while_read
from lctrain.progress_bar import ProgressBar
from lctrain.tokenizer import (
    BUILTIN_PREFIX,
    check_matches_model,
    load_tokenizer,
    resolve_anchor,
    text_encoder,
    tokenizer_fingerprint,
)
from lctrain.units import to_gb

SKIP_EXAMPLES = 5
# the shards store a segment's domain id as int8
MAX_DOMAINS = 127
# the SeedSequence child of data.seed that draws documents from data.sources (children 0-2 seed the _Builder)
SOURCES_DRAW_SEED = 3
NAMED_FILES = 5
NAMED_DOMAINS = 5
SMALL_BUDGET = 2_000_000
# The layout of the state an interrupted build saves (`_Builder.state`, the Mixture in it): raised when it changes, so
# a build interrupted under an older lctrain starts over instead of failing on the state it cannot read.
STATE_LAYOUT = 3
_SKIP_TEXT = {
    "malformed_json": "malformed JSON or not a JSON object",
    "no_text": "no string 'text' field",
    "empty_text": "empty text",
    "undecodable": "not valid UTF-8",
}


def _num_workers(requested: int, budget_tokens: int) -> int:
    """Tokenizer processes: as asked, at most one per usable core (tokenizing is CPU-bound: more only costs memory and
    start-up, and a config written for a larger machine must not start hundreds of processes on a small one)."""
    if requested > 0:
        return min(requested, usable_cpus())
    if budget_tokens < SMALL_BUDGET:
        return 1  # starting worker processes costs more than they save
    return usable_cpus()


def _out_of_memory(workers: int) -> UserError:
    return UserError(
        f"prepare: tokenizing ran out of memory ({workers} tokenizer process(es), data.num_workers); free memory "
        f"or lower data.num_workers, then run 'lctrain prepare' again: it resumes from its last complete shard"
    )


def _encoded(batches, encoder, workers: int):
    """Encoded batches in submission order; at most a few batches per worker in flight (bounded memory)."""
    try:
        if workers <= 1:
            encode.init_worker(encoder, single_thread=False)
            yield from map(encode.encode_batch, batches)
        else:
            yield from imap_ordered(encode.encode_batch, batches, workers, encode.init_worker, (encoder,))
    except MemoryError:  # Python's own, raised in a worker (and sent here) or in this process
        raise _out_of_memory(workers) from None
    except WorkerStartFailed as e:
        if isinstance(e.__cause__, MemoryError):
            raise _out_of_memory(workers) from None
        raise UserError(
            f"prepare: the tokenizer could not be set up in a worker process ({type(e.__cause__).__name__}: "
            f"{e.__cause__}); set data.num_workers=1 to tokenize in this process"
        ) from None
    except WorkerDied as e:
        how = death_of(e.signal) if e.signal else f"{e.how} without reporting an error"
        if e.signal == "SIGKILL":
            how += ": free memory or lower data.num_workers"
        raise UserError(
            f"prepare: a tokenizer worker process (of {workers}, data.num_workers) {how}; run 'lctrain prepare' "
            f"again: it resumes from its last complete shard"
        ) from None


def resolve_sources(cfg: Config) -> list[LocalFiles | None]:
    """The files of each source of `data.sources` (None for a hub source), resolved once; messages name the source."""
    out = []
    for i, s in enumerate(cfg.data.sources):
        if s.hub is not None:
            out.append(None)
            continue
        try:
            out.append(resolve_local_files(str(cfg.resolve_path(s.path)), s.split, cfg.data.seed))
        except UserError as e:
            raise UserError(f"data.sources[{i}] ({s.name}): {e}".replace("data.path", "path")) from None
    return out


def _say_shared_files(console, data, files: list[LocalFiles | None]) -> None:
    """The input files that more than one source reads: their documents would enter the mixture once per source."""
    readers: dict[Path, list[str]] = {}
    for s, f in zip(data.sources, files):
        for path in f.files if f is not None else ():
            readers.setdefault(path.resolve(), []).append(s.name)
    shared = [f"{path} ({' and '.join(names)})" for path, names in readers.items() if len(names) > 1]
    if shared:
        console.print(
            f"data.sources: {len(shared):,} file(s) read by more than one source, whose documents are then used once "
            f"per source: {first_and_more(shared, NAMED_FILES)}; list each file in one source",
            style="yellow",
            markup=False,
        )


def source_streams(data, files: list[LocalFiles | None]) -> list[SourceStream]:
    streams = []
    for i, (s, f) in enumerate(zip(data.sources, files)):
        key = f"data.sources[{i}]"
        fields = (s.text_field, *([s.domain_field.split(".")[0]] if s.domain_field else []))
        if f is None:
            batches = hub_batches(s.hub, s.split, data.seed, s.subset, key=f"{key}.hub", text_field=s.text_field)
        else:
            batches = local_batches(f.files, fields)
        # token shares are drawn in their proportions; SourceShares then admits each source up to its share
        weight = s.weight if s.token_share is None else s.token_share
        streams.append(SourceStream(s.name, s.text_field, s.domain_field, weight, batches, key))
    return streams


def initial_domains(data) -> tuple[str, ...]:
    """The domain names by id known before reading: SlimPajama's, or the names of the sources without a
    domain_field and the domains `data.domain_shares` names (a domain_field's values get ids as they come)."""
    if data.sources is None:
        return DOMAINS
    names = [s.name for s in data.sources if not s.domain_field] + list(keyed_by_domain(data) or {})
    return tuple(dict.fromkeys(names))


def _batches(data, files):
    """`files`: the resolved local files (resolved once, in `prepare`; per source with `data.sources`), None for the
    other sources."""
    if data.sources is not None:
        return mixed_batches(
            source_streams(data, files), np.random.SeedSequence(data.seed, spawn_key=(SOURCES_DRAW_SEED,))
        )
    if data.source == "synthetic":
        s = data.synthetic
        params = {
            "seed": data.seed,
            "median_words": s.median_words,
            "max_words": s.max_words,
            "long_doc_fraction": s.long_doc_fraction,
        }
        return synthetic_batches(s.num_docs, params)
    if data.source == "hub":
        return hub_batches(data.hub_name, data.hub_split, data.seed)
    return local_batches(files.files)


class _Builder:
    """The single-process half of the pipeline: shuffle, mixture, chunks, packing, writing, statistics.

    Documents and windows between the stages wait in `released` and `windows`, so that whenever a shard is complete
    the whole state (`RESUMABLE`, the writer's shards) is a consistent point to resume from: `on_shard` saves it."""

    RESUMABLE = (
        "buffer",
        "mixture",
        "shares",
        "packer",
        "stats",
        "skips",
        "released",
        "windows",
        "position",
        "counts",
        "read_by_domain",
        "domains",
        "tags",
    )

    def __init__(
        self,
        cfg: Config,
        anchor_id: int,
        tags: dict[int, np.ndarray] | None,
        out: Path,
        ids_dtype: str,
        encoder=None,
    ):
        """`ids_dtype`: how the shards store token ids (`store.token_dtype`); `encoder`: encodes the tag of a domain
        met while reading (with data.domain_tags)."""
        d = cfg.data
        self.domains = list(initial_domains(d))
        capacity = len(DOMAINS) if d.sources is None else MAX_DOMAINS
        self.tags = None if tags is None else dict(tags)  # tag ids per domain id; None without data.domain_tags
        self.tag_of = encoder.encode if tags is not None and encoder is not None else None
        self.num_windows = d.token_budget // d.seq_len
        self.min_doc_tokens = d.min_doc_tokens
        shuffle_seed, mix_seed, chunk_seed = np.random.SeedSequence(d.seed).spawn(3)
        # Capped at the budget: a larger buffer only delays the first window of a short build. It also narrows what a
        # budget smaller than the input samples to the input's head, which `_say_what_was_left_out` says.
        buffer_tokens = min(d.shuffle_buffer_tokens, self.num_windows * d.seq_len)
        self.buffer = ShuffleBuffer(buffer_tokens, np.random.default_rng(shuffle_seed))
        self.mixture = Mixture(
            d.mixture,
            self.num_windows * d.seq_len,
            d.short_doc_tokens,
            d.down_sample_ratio,
            np.random.default_rng(mix_seed),
            keyed_by_domain(d),
            tuple(self.domains),
            capacity,
        )
        self.shares = SourceShares(
            [None] if d.sources is None else [s.token_share for s in d.sources], self.num_windows * d.seq_len
        )
        self.packer = Packer(
            d.seq_len, anchor_id, tags, chunk_rng=np.random.default_rng(chunk_seed) if d.interleave_chunks else None
        )
        self.writer = ShardWriter(out, d.seq_len, max(1, d.shard_tokens // d.seq_len), ids_dtype)
        self.stats = DatasetStats(capacity)
        self.skips = _Skips(d.strict)
        self.released: deque = deque()  # documents out of the shuffle buffer, not yet packed
        self.windows: deque = deque()  # packed windows, not yet written
        self.position = (0, -1)  # (batch, record in it) of the last source record taken
        self.counts = {"records": 0, "documents": 0, "tokens": 0}
        # documents with text per domain id, also those left in the shuffle buffer: which domains the input has
        self.read_by_domain = np.zeros(capacity, dtype=np.int64)
        self.on_shard = None

    @property
    def done(self) -> bool:
        return self.writer.num_windows >= self.num_windows

    def state(self) -> dict:
        return {
            **{k: getattr(self, k) for k in self.RESUMABLE},
            "shards": self.writer.shards,
            "num_windows": self.writer.num_windows,
        }

    def restore(self, state: dict) -> None:
        for k in self.RESUMABLE:
            setattr(self, k, state[k])
        self.writer.resume(state["shards"], state["num_windows"])

    def domain_id(self, name: str) -> int:
        """The id of a `data.sources` domain, given the next one when it is new."""
        if name in self.domains:
            return self.domains.index(name)
        if len(self.domains) >= MAX_DOMAINS:
            raise UserError(
                f"data.sources: more than {MAX_DOMAINS} domains (the last one met: {name!r}); point domain_field at "
                f"a key with fewer distinct values"
            )
        self.domains.append(name)
        i = len(self.domains) - 1
        if self.tag_of is not None:
            tag = np.array(self.tag_of(name), dtype=np.int32)
            try:
                self.packer.add_tag(i, tag)
            except ValueError:
                raise UserError(
                    f"data.seq_len = {self.packer.seq_len} cannot hold an anchor, the {len(tag)}-token domain tag of "
                    f"{name!r} and text; raise data.seq_len or set data.domain_tags=false"
                ) from None
            self.tags[i] = tag
        return i

    def read(self, batch: int, record: int, source: str, line: int, domain, ids, reason: str | None) -> None:
        """Record `record` of source batch `batch`, as the workers encoded it (`domain`: an id, or a name of a
        `data.sources` (source index, domain name))."""
        self.position = (batch, record)
        index = 0  # of the data.sources source
        if isinstance(domain, tuple):
            index, name = domain
            domain = self.domain_id(name)
        self.counts["records"] += 1
        if reason is not None:
            self.skips.add(reason, source, line)
            return
        self.read_by_domain[domain] += 1
        if len(ids) < self.min_doc_tokens:
            self.skips.add("too_short", source, line)
            return
        self.counts["documents"] += 1
        self.counts["tokens"] += len(ids)
        self.released.extend(self.buffer.add((ids, domain, index), len(ids)))
        self._pump()

    def unused_documents(self) -> int:
        """Documents read past the budget, in no written window and dropped by no rule: those left in the shuffle
        buffer or read with the last batch, and those packed into windows past the last one written. After the
        source ended, the window being filled is its tail (`dropped_tail_tokens`), not read ahead."""
        ahead = len(self.released) + len(self.buffer) + sum(len(pw.doc_starts) for pw in self.windows)
        return ahead + self.packer.pending_documents if self.done else ahead

    def source_ended(self, batches: int) -> None:
        self.position = (batches, -1)
        self.released.extend(self.buffer.drain())
        self._pump()

    def _pump(self) -> None:
        while not self.done and (self.windows or self.released):
            if self.windows:
                pw = self.windows.popleft()
                self.stats.add(pw)
                self.shares.add_written(pw.source_tokens)
                if self.writer.add(pw.window) and self.on_shard is not None:
                    self.on_shard()
                continue
            tokens, domain, source = self.released.popleft()
            tag_len = len(self.tags[domain]) if self.tags is not None and domain in self.tags else 0
            if not self.mixture.admit(domain, len(tokens), 1 + tag_len + len(tokens)):
                continue
            take = self.shares.admit(source, 1 + tag_len, len(tokens))
            if take:
                self.windows.extend(self.packer.add(tokens[:take], domain, source, length=len(tokens)))
                self.shares.placed(source, self.packer.placed)


class _Skips:
    def __init__(self, strict: bool):
        self.strict = strict
        self.counts: Counter = Counter()
        self.examples: list[dict] = []

    def add(self, reason: str, source: str, line: int) -> None:
        if self.strict and reason in encode.MALFORMED:
            raise UserError(
                f"{source}:{line}: {_SKIP_TEXT[reason]} (--strict stops at the first bad record; "
                f"without it such records are skipped and counted)"
            )
        self.counts[reason] += 1
        if len(self.examples) < SKIP_EXAMPLES:
            self.examples.append({"reason": reason, "source": source, "line": line})

    def to_dict(self) -> dict:
        return {"counts": dict(sorted(self.counts.items())), "examples": self.examples}


def _progress():
    return ProgressBar(
        TextColumn("[bold]prepare"),
        BarColumn(),
        TextColumn("{task.completed:,}/{task.total:,} tokens"),
        TextColumn("{task.fields[docs]:,} docs read ({task.fields[docs_per_s]:,.0f}/s)"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        transient=False,
    )


@dataclass(frozen=True)
class InputChange:
    """How the input files differ from those a dataset was prepared from: `words` say it; `sizes`: their count or
    sizes differ (certainly other input), else only a file was modified since (same sizes: perhaps other text)."""

    words: str
    sizes: bool


def _input_change(prepared: dict, now: dict) -> InputChange | None:
    """How the input files differ from those a dataset was prepared from (`describe_source` then and now), as far
    as their count, sizes and modification times tell without reading them; None when they agree or there is
    nothing to compare (a hub or synthetic source, a manifest from before modification times were kept)."""

    def entries(source: dict) -> list[dict]:
        listed = source.get("sources") if source.get("kind") == "sources" else [source]
        return [e for e in listed if "bytes" in e]

    def sizes(source: dict) -> list[tuple]:
        return [(e.get("name"), e.get("files"), e.get("bytes")) for e in entries(source)]

    then, current = sizes(prepared), sizes(now)
    if then != current:

        def says(rows: list[tuple]) -> str:
            return "; ".join(
                f"{f'{n}: ' if n else ''}{files:,} file{'' if files == 1 else 's'}, {size:,} bytes"
                for n, files, size in rows
            )

        return InputChange(f"it was prepared from {says(then)}, the input is now {says(current)}", sizes=True)
    for old, new in zip(entries(prepared), entries(now)):
        if "newest_mtime" in old and new["newest_mtime"] > old["newest_mtime"]:
            name = f"{old['name']}: " if old.get("name") else ""
            return InputChange(
                f"{name}{new['newest_file']} was modified after the dataset was prepared "
                f"({_when(new['newest_mtime'])}; the newest input was from {_when(old['newest_mtime'])} then), though "
                f"the files' count and sizes agree",
                sizes=False,
            )
    return None


def _when(seconds: float) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(seconds))


def _resolve_inputs(cfg: Config):
    """The local input files (`LocalFiles`, a list of them with data.sources), None for a hub or synthetic source."""
    if cfg.data.sources is not None:
        return resolve_sources(cfg)
    if cfg.data.source == "local":
        return resolve_local_files(str(cfg.resolve_path(cfg.data.path)), cfg.data.hub_split, cfg.data.seed)
    return None


def input_change(cfg: Config, manifest: Manifest) -> InputChange | None:
    """How the input files of `cfg` differ from those `manifest`'s dataset was prepared from, or None: the data
    fingerprint holds the settings, not the files, so data appended to the corpus would otherwise go unread without a
    word. None too when the input is gone (a dataset may outlive its raw corpus): nothing to compare."""
    try:
        now = describe_source(cfg.data, _resolve_inputs(cfg))
    except UserError:
        return None
    return _input_change(manifest.source, now)


def _check_input_unchanged(cfg: Config, out: Path, manifest: Manifest, console) -> None:
    """Refuse to call `out` prepared when its input files changed since (`input_change`); only say so when just a
    modification time tells (a copy without its times, a `touch`: rebuilding a large corpus for nothing costs hours)."""
    changed = input_change(cfg, manifest)
    if changed is None:
        return
    if changed.sizes:
        raise UserError(
            f"{out}: already prepared, but the input files changed since ({changed.words}); run prepare again with "
            f"--force to rebuild it from them"
        )
    console.print(
        f"warning: {changed.words}: if its text changed, run prepare again with --force to rebuild the dataset from it",
        markup=False,
    )


def tokenizer_change(cfg: Config, manifest: Manifest) -> str | None:
    """How `data.tokenizer` now encodes otherwise than when `manifest`'s dataset was prepared, or None: the data
    fingerprint holds the tokenizer's name, not its files, so a tokenizer.json edited in place (a normalizer added,
    the vocabulary kept) or a hub repository updated would otherwise leave the old ids called prepared. None too for
    a manifest from before the digest was kept, or a tokenizer that cannot be loaded now: nothing to compare."""
    if manifest.tokenizer_digest is None:
        return None
    try:
        tok = load_tokenizer(cfg.resolve_source(cfg.data.tokenizer))
        digest = text_encoder(tok).digest()
        anchor = resolve_anchor(tok, cfg.data.anchor, cfg.data.tokenizer)
    except UserError:
        return None
    if digest != manifest.tokenizer_digest:
        return (
            f"it encodes text otherwise (tokenizer digest {digest[:12]}, the dataset's "
            f"{manifest.tokenizer_digest[:12]})"
        )
    if anchor.id != manifest.anchor.id:
        return (
            f"its anchor is now {anchor.token} (id {anchor.id}), the dataset's {manifest.anchor.token} (id "
            f"{manifest.anchor.id})"
        )
    return None


def _check_tokenizer_unchanged(cfg: Config, out: Path, manifest: Manifest) -> None:
    """Refuse to call `out` prepared when its tokenizer changed since (`tokenizer_change`)."""
    changed = tokenizer_change(cfg, manifest)
    if changed is not None:
        raise UserError(
            f"{out}: already prepared, but data.tokenizer = '{cfg.data.tokenizer}' changed since: {changed}; run "
            f"prepare again with --force to rebuild it with the tokenizer as it is now"
        )


def _check_nothing_skipped(out: Path, manifest: Manifest) -> None:
    """--strict on a dataset already prepared: `strict` is not a data setting (the same records make the same
    windows), so the dataset may come from a build that skipped the records --strict stops at, and "nothing to do"
    would be a false all-clear for a corpus being validated."""
    counts = manifest.skipped.get("counts", {})
    bad = {reason: n for reason, n in counts.items() if reason in encode.MALFORMED and n}
    if bad:
        raise UserError(
            f"{out}: already prepared, but its build skipped {sum(bad.values()):,} bad records without --strict "
            f"({', '.join(f'{n:,} {reason}' for reason, n in bad.items())}; {MANIFEST}: skipped.counts); run prepare "
            f"again with --strict --force to rebuild it, stopping at the first one"
        )


def _existing_is_current(out: Path, fingerprint: str, force: bool) -> tuple[Manifest | None, str | None]:
    """(the manifest when `out` already holds this dataset, why a damaged one of ours there is rebuilt); raises when
    `out` holds something else and force is off."""
    if not out.exists():
        return None, None
    if not out.is_dir():
        raise UserError(f"data.output_dir = '{out}' exists and is not a directory; choose another data.output_dir")
    manifest, problem = dataset_problem(out)
    if isinstance(problem, Newer) and not force:
        raise UserError(
            f"{out}: {problem}: rebuilding it here would replace it; upgrade lctrain, or rerun with --force to "
            f"rebuild it with this one"
        )
    if manifest is None:
        if (out / MANIFEST).exists():
            return None, str(problem)  # a damaged dataset of ours, or one of an older format: rebuild it
        if not any(out.iterdir()):
            return None, None
        raise UserError(
            f"{out} exists, is not empty and is not a prepared dataset; remove it or choose another data.output_dir"
        )
    if manifest.data_fingerprint == fingerprint:
        return (None if force else manifest), None
    if not force:
        raise UserError(
            f"{out} holds a dataset with another data fingerprint ({manifest.data_fingerprint[:12]}, this config "
            f"{fingerprint[:12]}); rerun with --force to replace it or set data.output_dir"
        )
    return None, None


def _remove_stale(out: Path) -> None:
    """Remove the old datasets that killed runs were replacing, and the build directories of older lctrain versions
    (their process is gone)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(partial|old)-(\d+)$")
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and (int(m.group(2)) == os.getpid() or not is_alive(int(m.group(2)))):
            shutil.rmtree(p, ignore_errors=True)


def _refuse_while_trained_on(out: Path) -> None:
    """Refuse to replace a dataset a training reads (its `Reading` mark, lctrain.train.command): the rebuild would
    delete its shards under it, and it would stop at its next read."""
    refuse_while_read(out, "rebuilding it here (or set data.output_dir to prepare the new dataset elsewhere)")


def _move_into_place(tmp: Path, out: Path) -> None:
    old = out.parent / f".{out.name}.old-{os.getpid()}"
    with writing(out, "the prepared dataset"):
        if out.exists():
            os.rename(out, old)
        os.rename(tmp, out)
    shutil.rmtree(old, ignore_errors=True)


def _write_error(out: Path, e: OSError) -> UserError:
    return UserError(
        f"cannot write the dataset to {out} ({e.strerror or e}); check free space and permissions, or "
        f"set data.output_dir to a writable place"
    )


def _tokenizer_info(spec: str, tok, encoder, anchor_id: int) -> dict:
    builtin = spec.startswith(BUILTIN_PREFIX)
    name = spec.removeprefix(BUILTIN_PREFIX) if builtin else str(getattr(tok, "name_or_path", spec))
    return {
        "spec": spec,
        "name": name,
        "vocab_size": len(tok),
        "fingerprint": tokenizer_fingerprint(tok),  # perplexity refuses data whose ids mean other tokens
        "encoder": encoder.kind,
        "anchor_id": anchor_id,
        "bos_id": tok.bos_token_id,
        "eos_id": tok.eos_token_id,
    }


def prepare(cfg: Config, force: bool = False) -> Path:
    """Build the packed dataset of `cfg.data` at `data_dir(cfg)`; a no-op when it is already there."""
    d = cfg.data
    console = plain_console()
    warnings = message_console()
    out = data_dir(cfg)
    fingerprint = data_fingerprint(d)
    num_windows = d.token_budget // d.seq_len
    if num_windows < 1:
        raise UserError(
            f"data.token_budget = {d.token_budget} is smaller than one window (data.seq_len = "
            f"{d.seq_len}); set data.token_budget to at least {d.seq_len}"
        )
    # said once the inputs passed their checks: a refusal is then the only line a bad input gets
    reread = reread_warning(cfg, num_windows)
    current, damage = _existing_is_current(out, fingerprint, force)
    if current is not None:
        check_matches_model(cfg)
        _check_input_unchanged(cfg, out, current, warnings)
        _check_tokenizer_unchanged(cfg, out, current)
        if d.strict:
            _check_nothing_skipped(out, current)
        if reread:
            warnings.print(reread, markup=False)
        console.print(f"{out}: already prepared (data fingerprint {fingerprint[:12]}); nothing to do")
        left = Partial(out).dir
        if left.is_dir():  # a `--force` rebuild stopped before it was complete: disk space nothing else will free
            size = sum(f.stat().st_size for f in left.rglob("*") if f.is_file())
            console.print(
                f"note: {left} holds an interrupted rebuild ({to_gb(size):.2f} GB): 'lctrain prepare --force' "
                f"resumes it, or delete it",
                markup=False,
            )
        return out
    _refuse_while_trained_on(out)
    if damage:
        console.print(f"{out}: rebuilding it ({damage})", markup=False)
    # resolving validates local paths before the slow tokenizer load; done once, a SlimPajama tree is large
    files = _resolve_inputs(cfg)
    if d.sources is not None:
        _say_shared_files(warnings, d, files)
    domains = initial_domains(d)
    source = describe_source(d, files)
    tok = load_tokenizer(cfg.resolve_source(d.tokenizer))
    check_matches_model(cfg, tok)
    # torch and the model classes on use: prepare loads without them (start-up time)
    from lctrain.model import check_model_class

    check_model_class(cfg)  # a model lctrain cannot train, refused before the corpus is tokenized for it
    encoder = text_encoder(tok)
    anchor = resolve_anchor(tok, d.anchor, d.tokenizer)
    anchor_id = anchor.id
    tags = None
    if d.domain_tags:
        tags = {i: np.array(encoder.encode(name), dtype=np.int32) for i, name in enumerate(domains)}
        longest = max((len(t) for t in tags.values()), default=0)
        if d.seq_len < longest + 2:
            raise UserError(
                f"data.seq_len = {d.seq_len} cannot hold an anchor, a {longest}-token domain tag and "
                f"text; raise data.seq_len or set data.domain_tags=false"
            )
    if reread:
        warnings.print(reread, markup=False)
    workers = _num_workers(d.num_workers, num_windows * d.seq_len)

    partial = Partial(out)
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(out)
        partial.open()
    except OSError as e:
        raise _write_error(out, e) from None
    tokenizer = _tokenizer_info(d.tokenizer, tok, encoder, anchor_id)
    # what must not have changed for an interrupted run's state to be resumed
    resume_key = {
        "format_version": FORMAT_VERSION,  # how documents are encoded: shards of an older rule are not continued
        "state_layout": STATE_LAYOUT,
        "data_fingerprint": fingerprint,
        "shard_tokens": d.shard_tokens,
        # by the largest id, not the count: a vocabulary may leave ids unused (shards of another width: not continued)
        "token_dtype": token_dtype(max(tok.get_vocab().values()) + 1),
        "tokenizer": tokenizer,
        "tokenizer_digest": encoder.digest(),
        "source": _source_identity(files, source),
    }
    if d.sources is not None:
        what_source = f"{len(d.sources)} source{'' if len(d.sources) == 1 else 's'} of data.sources"
    else:
        what_source = f"{source['kind']} source"
    console.print(
        f"preparing {out}: {what_source}, tokenizer {d.tokenizer}, {num_windows:,} windows of "
        f"{d.seq_len:,} tokens, mixture {d.mixture}, {workers} worker(s)"
    )
    if workers < d.num_workers:
        warnings.print(
            f"data.num_workers = {d.num_workers} is more than the {workers} CPU cores this process may use: "
            f"{workers} tokenizer processes",
            style="yellow",
        )
    console.print(f"anchor: {anchor.token} (id {anchor.id}; {anchor.why})", markup=False)
    builder = None
    try:
        saved = partial.load(resume_key)
        if saved is None or not _shards_intact(partial.dir, saved["shards"]):
            if partial.has_progress():  # else it would only show as a build that takes longer than expected
                warnings.print(
                    f"starting over: {partial.dir} holds an interrupted prepare of other settings, tokenizer or "
                    f"input files (or shards changed since), which is discarded",
                    style="yellow",
                    markup=False,
                )
            saved = None
            partial.start_over()
        builder = _Builder(cfg, anchor_id, tags, partial.dir, resume_key["token_dtype"], encoder)
        if saved is not None:
            builder.restore(saved)
            console.print(
                f"resuming an interrupted prepare after its last complete shard ({len(saved['shards'])} shard(s), "
                f"{saved['num_windows']:,} windows)"
            )
        resumed_shards = len(builder.writer.shards)
        # what an interrupted run wrote and read before: this session's rates leave it out
        windows_before, tokens_before = builder.writer.num_windows, builder.counts["tokens"]
        builder.on_shard = lambda: partial.save(resume_key, builder.state())
        t0 = time.perf_counter()
        estimate = InputEstimate.of(files.files) if d.source == "local" and d.sources is None else None
        read = _read(builder, _batches(d, files), encoder, workers, d.seq_len, estimate)
        elapsed = time.perf_counter() - t0
        left_out = _left_out_by_settings(d, builder, read["skipped"]["counts"])
        if builder.writer.num_windows == 0:
            # no manifest is written, so the skip table is never shown: say here why records were not usable
            skipped = ", ".join(f"{n:,} {reason}" for reason, n in read["skipped"]["counts"].items())
            read_from = _files_read(source)
            read_from = f" ({read_from})" if read_from else ""
            yielded = (
                f"the {what_source}{read_from} yielded {read['tokens']:,} tokens in {read['documents']:,} "
                f"usable documents{f' (skipped: {skipped})' if skipped else ''}"
            )
            if left_out:
                raise UserError(
                    f"{yielded}, and the settings left out {'; '.join(left_out)}: not one "
                    f"{d.seq_len:,}-token window was filled"
                )
            raise UserError(f"{yielded}, not enough for one {d.seq_len:,}-token window; add data or lower data.seq_len")
        shards = builder.writer.close()
        stats = builder.stats.to_dict(builder.mixture.target_shares(), tuple(builder.domains))
        packed = builder.writer.num_windows * d.seq_len
        packed_now = packed - windows_before * d.seq_len
        manifest = Manifest(
            format_version=FORMAT_VERSION,
            complete=True,
            data_fingerprint=fingerprint,
            config_fingerprint=config_fingerprint(cfg),
            seq_len=d.seq_len,
            num_windows=builder.writer.num_windows,
            num_tokens=packed,
            mixture=d.mixture,
            token_budget=d.token_budget,
            domain_tags=d.domain_tags,
            interleave_chunks=d.interleave_chunks,
            short_doc_tokens=d.short_doc_tokens,
            down_sample_ratio=d.down_sample_ratio,
            domains=list(builder.domains),
            tokenizer=tokenizer,
            anchor=anchor.record(),
            tags={builder.domains[i]: t.tolist() for i, t in builder.tags.items()} if builder.tags else None,
            seed=d.seed,
            shuffle={"file_order": "seeded permutation", "buffer_tokens": builder.buffer.max_tokens},
            stats=stats,
            skipped=read["skipped"],
            mixture_dropped={**builder.mixture.dropped, **builder.shares.dropped},
            source={
                **_with_achieved_shares(source, builder.shares.achieved()),
                "records_read": read["records"],
                "documents_read": read["documents"],
                "tokens_read": read["tokens"],
            },
            source_exhausted=read["exhausted"],
            dropped_tail_tokens=sum(read["tail"].values()),
            dropped_tail_by_domain=read["tail"],
            shards=shards,
            token_dtype=resume_key["token_dtype"],
            tokenizer_digest=resume_key["tokenizer_digest"],
            build={
                "seconds": round(elapsed, 3),
                "packed_tokens_per_s": round(packed_now / max(elapsed, 1e-9)),
                "tokenized_tokens_per_s": round((read["tokens"] - tokens_before) / max(elapsed, 1e-9)),
                "num_workers": workers,
                "lctrain_version": __version__,
                **(
                    {"resumed_after_shards": resumed_shards, "resumed_after_windows": windows_before}
                    if resumed_shards
                    else {}
                ),
            },
        )
        _refuse_while_trained_on(out)  # again: a training may have started on it while this one built
        write_resolved(cfg, partial.dir)
        write_manifest(partial.dir, manifest)
        partial.finish()
        _move_into_place(partial.dir, out)
        partial.close(keep=True)
    except BaseException as e:
        if builder is not None:
            with contextlib.suppress(OSError):  # closing the shard flushes it, which fails again on a full disk
                builder.writer.abort()
        # keep what a later run can resume from; nothing else is left behind
        kept = partial.has_progress()
        partial.close(keep=kept)
        if is_environment_error(e) and not isinstance(e, UserError):  # a UserError already says which file
            raise _write_error(out, e) from None
        if isinstance(e, KeyboardInterrupt) and kept:  # Ctrl-C or SIGTERM: the command's last words say this
            said = "interrupted; the same 'lctrain prepare' again resumes after its last complete shard"
            raise type(e)(said) from None
        raise
    render(console, stats, read["skipped"])
    if d.sources is not None:
        _say_source_shares(console, manifest.source["sources"])
    _say_what_was_left_out(warnings, manifest, num_windows, cfg, left_out)
    _say_domains_left_out(warnings, d, builder)
    _say_share_misses(warnings, stats, manifest, bool(left_out))
    # read past the budget (counted as read, in no window and in no other count), so "N docs read" adds up
    ahead = (
        f"; {read['unused']:,} more documents read ahead were not needed"
        if read["unused"] > 0 and not resumed_shards
        else ""
    )
    console.print(
        f"wrote {manifest.num_windows:,} windows ({packed:,} tokens, {stats['documents']:,} documents{ahead}) to "
        f"{out} in {elapsed:.1f} s"
        f"{f' after resuming at {windows_before:,}' if resumed_shards else ''} "
        # tokenized this session: a resumed run packs the restored shuffle buffer's tokens too, read before
        f"({manifest.build['tokenized_tokens_per_s']:,} tokens/s tokenized)"
    )
    return out


def _with_achieved_shares(source: dict, achieved: list[float]) -> dict:
    """The manifest's source record with each `data.sources` entry's measured share of the written tokens."""
    if source["kind"] != "sources":
        return source
    return {**source, "sources": [{**e, "achieved_token_share": a} for e, a in zip(source["sources"], achieved)]}


def _say_source_shares(console, sources: list[dict]) -> None:
    asked = [f"weight {e['weight']:g}" for e in sources]
    if sources[0]["token_share"] is not None:
        shares = [e["token_share"] for e in sources]
        # shares summing to 1 only up to rounding are used as fractions of their sum: show that fraction
        asked = [
            f"token_share {s:.4f}{f' ({t:.4f} of their sum)' if round(t, 4) != round(s, 4) else ''}"
            for s, t in zip(shares, normalized(shares))
        ]
    console.print(
        "share of the written tokens per source (asked -> achieved): "
        + ", ".join(f"{e['name']} {a} -> {e['achieved_token_share']:.4f}" for e, a in zip(sources, asked)),
        markup=False,
    )


def _source_identity(files, source: dict):
    """What must not have changed in the input for an interrupted prepare to resume."""
    if isinstance(files, list):
        return [f.identity() if f is not None else None for f in files] + [source]
    return files.identity() if files is not None else source


def _shards_intact(directory: Path, shards: list[dict]) -> bool:
    """Whether the shards an interrupted run completed are still what it wrote (every byte checked)."""
    for s in shards:
        path = directory / s["file"]
        if not path.is_file() or path.stat().st_size != s["bytes"]:
            return False
        if file_checksums(path) != (s["checksum"], s["edge_checksum"]):
            return False
    return True


def settings_left_out(manifest: Manifest) -> bool:
    """Whether the data settings turned documents away in the build `manifest` records (`_left_out_by_settings`
    names them and their counts as prepare runs)."""
    mixture = ("short_doc_downsampled", "domain_without_share", "domain_share_full", "source_share_full")
    too_short = manifest.skipped.get("counts", {}).get("too_short", 0)
    return too_short > 0 or any(manifest.mixture_dropped.get(k, 0) for k in mixture)


def _left_out_by_settings(data, builder: _Builder, skipped: dict[str, int]) -> list[str]:
    """The documents that data.min_doc_tokens, the mixture and the share caps turned away, each with the setting that
    lets them in: when the input runs out before the budget, they, not a lack of input, may be what stopped it."""
    dropped = {**builder.mixture.dropped, **builder.shares.dropped}
    unshared = [f"{builder.domains[i]} {int(n):,}" for i, n in enumerate(builder.mixture.without_share) if n]
    reasons = [
        (skipped.get("too_short", 0), f"shorter than data.min_doc_tokens = {data.min_doc_tokens:,} (lower it)"),
        (
            dropped.get("short_doc_downsampled", 0),
            f"down-sampled as shorter than data.short_doc_tokens = {data.short_doc_tokens:,} (raise "
            f"data.down_sample_ratio = {data.down_sample_ratio:g} or lower data.short_doc_tokens)",
        ),
        (
            dropped.get("domain_without_share", 0),
            f"of domains without a share ({first_and_more(unshared, NAMED_DOMAINS)}: give them one in "
            f"data.domain_shares, or read other domains from the records: "
            f"{'meta.redpajama_set_name' if data.sources is None else 'a source domain_field'})",
        ),
        (
            dropped.get("domain_share_full", 0),
            "of domains whose share was full while others' were not (lower data.domain_shares of the domains that "
            "ran out)",
        ),
        (
            dropped.get("source_share_full", 0),
            "of sources whose token_share was full while others' were not (lower the token_share of the sources "
            "that ran out)",
        ),
    ]
    return [f"{n:,} documents {why}" for n, why in reasons if n]


def _files_read(source: dict) -> str:
    """The input files the local sources of a manifest's `source` read, for a message that says they held too
    little: which and how large, and those skipped ("" for a hub or synthetic source)."""
    local = [source] if source["kind"] == "local" else [e for e in source.get("sources", ()) if "path" in e]
    read = [f"{_file_count(e)}, {e['bytes']:,} byte{'' if e['bytes'] == 1 else 's'}" for e in local]
    if source["kind"] == "sources":
        read = [f"{e['name']}: {r}" for e, r in zip(local, read)]
    return "; ".join(filter(None, [*read, _skipped_files(source)]))


def _file_count(entry: dict) -> str:
    return entry["newest_file"] if entry["files"] == 1 else f"{entry['files']:,} files"


def _skipped_files(source: dict) -> str:
    """`skipped N input file(s): PATH (why); ...` from a manifest's `source`, or "" when none was."""
    skipped = source.get("skipped_files") or []
    if not skipped:
        return ""
    named = "; ".join(f"{f['path']} ({f['reason']})" for f in skipped[:NAMED_FILES])
    if len(skipped) > NAMED_FILES:
        named += f"; and {len(skipped) - NAMED_FILES:,} more (manifest.json: source.skipped_files)"
    return f"skipped {len(skipped):,} input file(s): {named}"


def _say_what_was_left_out(console, manifest: Manifest, planned_windows: int, cfg: Config, left_out: list[str]) -> None:
    """The input files not read, the source's tail that could not fill a window, a source shorter than the budget
    (and the documents the settings turned away, `_left_out_by_settings`, when they may be why)."""
    skipped = _skipped_files(manifest.source)
    if skipped:
        console.print(skipped, style="yellow", markup=False)
    if manifest.dropped_tail_tokens:
        per_domain = ", ".join(f"{d} {n:,}" for d, n in manifest.dropped_tail_by_domain.items())
        console.print(
            f"the source's last {manifest.dropped_tail_tokens:,} tokens ({per_domain}; anchors and tags included) "
            f"cannot fill a {manifest.seq_len:,}-token window and were not written",
            style="yellow",
        )
    if manifest.source_exhausted:
        why = f"; the settings left out {'; '.join(left_out)}" if left_out else ""
        console.print(
            f"the source ran out before the budget: {manifest.num_windows:,} of {planned_windows:,} windows "
            f"({manifest.num_tokens:,} tokens) written{why}",
            style="yellow",
            markup=False,
        )
        reread = reread_warning(cfg, manifest.num_windows, source_exhausted=True, settings_left_out=bool(left_out))
        if reread:
            console.print(reread, style="yellow", markup=False)
    buffer = manifest.shuffle.get("buffer_tokens")
    if not manifest.source_exhausted and cfg.data.source != "synthetic" and buffer < cfg.data.shuffle_buffer_tokens:
        console.print(
            f"the documents were shuffled through a buffer of {buffer:,} tokens (data.shuffle_buffer_tokens, at most "
            f"the budget): the windows hold documents of the first {manifest.source['tokens_read']:,} tokens read, "
            f"the input's files in a seeded order, not a sample of the whole input",
            style="yellow",
            markup=False,
        )


def _say_domains_left_out(console, data, builder: _Builder) -> None:
    """The `data.domain_shares` domains the input has no document of (their shares stay unfilled), and the documents
    skipped because their domain has no share: a misspelt domain would otherwise only show as fewer windows."""
    shares = keyed_by_domain(data)
    if shares is not None:
        read = [name for i, name in enumerate(builder.domains) if builder.read_by_domain[i]]
        unread = [name for name, share in shares.items() if share > 0 and name not in read]
        if unread:
            console.print(
                f"data.domain_shares: the input has no document of {', '.join(unread)} (the domains read: "
                f"{', '.join(read) or 'none'}); {'its share stays' if len(unread) == 1 else 'their shares stay'} "
                f"unfilled: key data.domain_shares by the domains read",
                style="yellow",
                markup=False,
            )
    skipped = builder.mixture.without_share
    if skipped.sum():
        per_domain = [f"{builder.domains[i]} {int(n):,}" for i, n in enumerate(skipped) if n]
        console.print(
            f"skipped {int(skipped.sum()):,} documents whose domain has no token share (data.domain_shares): "
            f"{first_and_more(per_domain, NAMED_DOMAINS)}; give a domain a share to use its documents",
            style="yellow",
            markup=False,
        )


def _say_share_misses(console, stats: dict, manifest: Manifest, left_out: bool) -> None:
    """The domains whose written token share is off its `upsampled` target, or the sources off their `token_share`
    (`share_misses`). `left_out`: the settings turned documents away (`_left_out_by_settings`)."""
    sources = manifest.source.get("sources") or []
    if any(e["token_share"] is not None for e in sources):
        targets = normalized([e["token_share"] for e in sources])
        misses = share_misses({e["name"]: (t, e["achieved_token_share"]) for e, t in zip(sources, targets)})
        what, more = "data.sources missed the token_share of", "documents to these sources or lower their token_share"
        kind = "source"
    else:
        domains = stats["domains"].items()
        misses = share_misses(
            {n: (e["target_tokens_share"], e["tokens_share"]) for n, e in domains if "target_tokens_share" in e}
        )
        what, more = (
            "the upsampled mixture missed the token shares of",
            "documents of these domains or lower their data.domain_shares",
        )
        kind = "domain"
    if not misses:
        return
    named = first_and_more(
        [f"{name} {target:.1%} -> {achieved:.1%}" for name, target, achieved in misses], NAMED_DOMAINS
    )
    if manifest.source_exhausted and left_out:
        advice = "the input ran out before the budget, with documents left out by the settings named above"
    elif manifest.source_exhausted:
        advice = f"the input ran out before the budget: add {more}"
    else:
        advice = "a larger data.token_budget brings the shares closer"
        if kind == "domain":
            advice = f"each domain may miss by up to one document: {advice}"
    console.print(
        f"{what} {len(misses)} {kind}(s) by more than {100 * SHARE_TOLERANCE:g} percentage point (target -> "
        f"achieved): {named}; {advice}",
        style="yellow",
        markup=False,
    )


class InputEstimate:
    """The tokens a local input will pack into, estimated as it is read, for the progress bar when
    `data.token_budget` is more than the input holds ("use all of it": a bar and ETA of the budget would say hours for
    minutes). The files are read whole, one after another in their seeded order, so when file `i` starts, files
    `0..i-1` are done: the tokens read by then over their bytes, times every file's bytes (tokens read, not packed:
    packing lags reading by the shuffle buffer). None before a file is done. Compressed and plain files mixed make it
    rougher, not wrong for long."""

    def __init__(self, sizes: list[tuple[str, int]]):
        self.index = {name: i for i, (name, _) in enumerate(sizes)}
        self.before = [0]  # bytes of the files before file i
        for _, size in sizes:
            self.before.append(self.before[-1] + size)
        self.current, self.read_at_start = None, 0

    @classmethod
    def of(cls, files: list[Path]) -> InputEstimate:
        return cls([(str(f), f.stat().st_size) for f in files])

    def tokens(self, source: str, read: int) -> int | None:
        """The input's tokens, estimated when a batch of file `source` comes and `read` tokens were read before it."""
        if source != self.current:
            self.current, self.read_at_start = source, read
        done = self.before[self.index[source]] if source in self.index else 0
        return round(self.read_at_start * self.before[-1] / done) if done else None


def _read(
    builder: _Builder, batches, encoder, workers: int, seq_len: int, estimate: InputEstimate | None = None
) -> dict:
    """Feed the source to `builder`, from where an interrupted run left it (`builder.position`)."""
    first_batch, last_record = builder.position
    budget = builder.num_windows * seq_len
    t0, docs_before = time.perf_counter(), builder.counts["documents"]
    with _progress() as bar:
        # a resumed run's bar starts where it was left, so its rate and ETA are this session's
        task = bar.add_task(
            "prepare", total=budget, completed=builder.writer.num_windows * seq_len, docs=docs_before, docs_per_s=0.0
        )
        # a resumed run skips the batches it consumed without tokenizing them
        encoded = _encoded(itertools.islice(batches, first_batch, None), encoder, workers)
        b = first_batch - 1
        try:
            for b, batch in enumerate(encoded, start=first_batch):
                held = None
                if estimate is not None and batch:
                    held = estimate.tokens(batch[0][0], builder.counts["tokens"])
                for j, (source, line, domain, ids, reason) in enumerate(batch):
                    if b > first_batch or j > last_record:
                        builder.read(b, j, source, line, domain, ids, reason)
                packed = builder.writer.num_windows * seq_len
                bar.update(
                    task,
                    total=min(budget, max(held, packed)) if held is not None else budget,
                    completed=packed,
                    docs=builder.counts["documents"],
                    docs_per_s=(builder.counts["documents"] - docs_before) / max(time.perf_counter() - t0, 1e-9),
                )
                if builder.done:
                    break
        finally:
            # the workers end now: when the budget is full before the source ends, and on an error here (a full disk
            # while a shard is written), before the cleanup, not when the error's traceback is let go
            encoded.close()
        if not builder.done:
            builder.source_ended(b + 1)
        exhausted = not builder.done
        packed = builder.writer.num_windows * seq_len
        bar.update(task, completed=packed, total=packed if exhausted else budget)
    tail = builder.packer.pending_by_domain() if exhausted else {}
    return {
        "skipped": builder.skips.to_dict(),
        **builder.counts,
        "exhausted": exhausted,
        "tail": {builder.domains[dom]: n for dom, n in sorted(tail.items())},
        "unused": builder.unused_documents(),
    }
