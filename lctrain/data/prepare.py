"""`lctrain prepare`: read a corpus, tokenize it on all cores, pack it into windows, write the packed store.

The pipeline is a stream with bounded memory whatever the token budget:

    source batches -> workers (parse, tokenize; results in submission order) -> skip/filter -> shuffle buffer
    -> mixture -> packer (-> interleaved chunks within each window) -> Arrow shards

Everything after the workers runs in this process with seeded generators, so the output is byte-identical for a
given config whatever the number of workers. The dataset is built in a hidden sibling directory and renamed into
place only when complete; an interrupted run leaves no directory that looks complete.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import re
import shutil
import time
from collections import Counter, deque
from concurrent.futures import ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path

import numpy as np
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

from lctrain import __version__
from lctrain.config import (
    DOMAINS,
    Config,
    config_fingerprint,
    data_dir,
    data_fingerprint,
    reread_warning,
    write_resolved,
)
from lctrain.data import encode
from lctrain.data.mixture import Mixture
from lctrain.data.packing import Packer, ShuffleBuffer
from lctrain.data.sources import describe_source, hub_batches, local_batches, resolve_local_files, synthetic_batches
from lctrain.data.stats import DatasetStats, render
from lctrain.data.store import FORMAT_VERSION, MANIFEST, ShardWriter, read_manifest, write_manifest
from lctrain.errors import UserError, is_environment_error
from lctrain.hardware import usable_cpus
from lctrain.lifetime import is_alive
from lctrain.tokenizer import BUILTIN_PREFIX, load_tokenizer, resolve_anchor, text_encoder, tokenizer_fingerprint

SHARD_TOKENS = 1 << 28  # ~1 GiB of int32 tokens per Arrow shard
SKIP_EXAMPLES = 5
SMALL_BUDGET = 2_000_000
_SKIP_TEXT = {
    "malformed_json": "not a JSON object",
    "no_text": "no string 'text' field",
    "empty_text": "empty text",
    "undecodable": "not valid UTF-8",
}


def _console():
    return Console(highlight=False, soft_wrap=True)


def _num_workers(requested: int, budget_tokens: int) -> int:
    if requested > 0:
        return requested
    if budget_tokens < SMALL_BUDGET:
        return 1  # starting worker processes costs more than they save
    return usable_cpus()


def _encoded(batches, encoder, workers: int):
    """Encoded batches in submission order; at most a few batches per worker in flight (bounded memory)."""
    if workers <= 1:
        encode.init_worker(encoder, single_thread=False)
        for b in batches:
            yield encode.encode_batch(b)
        return
    ctx = multiprocessing.get_context("spawn")  # fork after tokenizers' threads have started can deadlock
    with ProcessPoolExecutor(workers, mp_context=ctx, initializer=encode.init_worker, initargs=(encoder,)) as ex:
        pending = deque()
        try:
            for b in batches:
                pending.append(ex.submit(encode.encode_batch, b))
                if len(pending) >= 4 * workers:
                    yield pending.popleft().result()
            while pending:
                yield pending.popleft().result()
        except BrokenProcessPool:
            # A worker that raises reports its exception; one that ends without a word was killed by a signal,
            # which the pool does not keep: SIGKILL from the out-of-memory killer is the usual one.
            raise UserError(
                f"prepare: a tokenizer worker process (of {workers}, data.num_workers) was killed by the OS, most "
                f"likely by SIGKILL from the out-of-memory killer; free memory or lower data.num_workers, then run "
                f"'lctrain prepare' again (it starts over)"
            ) from None
        finally:
            for f in pending:
                f.cancel()


def _batches(data, files: list[Path] | None):
    """`files`: the resolved local files (resolved once, in `prepare`), None for the other sources."""
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
    return local_batches(files)


class _Builder:
    """The single-process half of the pipeline: shuffle, mixture, chunks, packing, writing, statistics."""

    def __init__(self, cfg: Config, anchor_id: int, tags: dict[int, np.ndarray] | None, out: Path):
        d = cfg.data
        self.num_windows = d.token_budget // d.seq_len
        shuffle_seed, mix_seed, chunk_seed = np.random.SeedSequence(d.seed).spawn(3)
        # a buffer larger than the dataset shuffles no better and only delays the first window
        buffer_tokens = min(d.shuffle_buffer_tokens, self.num_windows * d.seq_len)
        self.buffer = ShuffleBuffer(buffer_tokens, np.random.default_rng(shuffle_seed))
        self.mixture = Mixture(
            d.mixture,
            self.num_windows * d.seq_len,
            d.short_doc_tokens,
            d.down_sample_ratio,
            np.random.default_rng(mix_seed),
            d.domain_shares,
        )
        self.tag_len = {i: len(tags[i]) if tags else 0 for i in range(len(DOMAINS))}
        self.packer = Packer(
            d.seq_len, anchor_id, tags, chunk_rng=np.random.default_rng(chunk_seed) if d.interleave_chunks else None
        )
        self.writer = ShardWriter(out, d.seq_len, shard_windows=max(1, SHARD_TOKENS // d.seq_len))
        self.stats = DatasetStats()

    @property
    def done(self) -> bool:
        return self.writer.num_windows >= self.num_windows

    def take(self, tokens: np.ndarray, domain: int) -> None:
        """A document leaves the shuffle buffer."""
        size = 1 + self.tag_len[domain] + len(tokens)
        if self.done or not self.mixture.admit(domain, len(tokens), size):
            return
        for pw in self.packer.add(tokens, domain):
            if self.done:
                return
            self.stats.add(pw)
            self.writer.add(pw.window)


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


def _progress(console):
    return Progress(
        TextColumn("[bold]prepare"),
        BarColumn(),
        TextColumn("{task.completed:,}/{task.total:,} tokens"),
        TextColumn("{task.fields[docs]:,} docs ({task.fields[docs_per_s]:,.0f}/s)"),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        console=console,
        transient=False,
    )


def _existing_is_current(out: Path, fingerprint: str, force: bool) -> bool:
    """True when `out` already holds this dataset; raises when it holds something else and force is off."""
    if not out.exists():
        return False
    if not out.is_dir():
        raise UserError(f"data.output_dir = '{out}' exists and is not a directory; choose another data.output_dir")
    manifest = read_manifest(out)
    if manifest is None:
        if (out / MANIFEST).exists() or not any(out.iterdir()):
            return False  # an empty directory or a broken dataset of ours: rebuild it
        raise UserError(
            f"{out} exists, is not empty and is not a prepared dataset; remove it or choose another data.output_dir"
        )
    if manifest.get("data_fingerprint") == fingerprint:
        return not force  # read_manifest already turned away an older format, which is rebuilt
    if not force:
        theirs = str(manifest.get("data_fingerprint", "?"))[:12]
        raise UserError(
            f"{out} holds a dataset with another data fingerprint ({theirs}, this config "
            f"{fingerprint[:12]}); rerun with --force to replace it or set data.output_dir"
        )
    return False


def _remove_stale(out: Path) -> None:
    """Remove what killed runs left behind (their process is gone)."""
    pattern = re.compile(rf"^\.{re.escape(out.name)}\.(partial|old)-(\d+)$")
    for p in out.parent.iterdir():
        m = pattern.match(p.name)
        if m and (int(m.group(2)) == os.getpid() or not is_alive(int(m.group(2)))):
            shutil.rmtree(p, ignore_errors=True)


def _move_into_place(tmp: Path, out: Path) -> None:
    old = out.parent / f".{out.name}.old-{os.getpid()}"
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
    console = _console()
    out = data_dir(cfg)
    fingerprint = data_fingerprint(d)
    num_windows = d.token_budget // d.seq_len
    if num_windows < 1:
        raise UserError(
            f"data.token_budget = {d.token_budget} is smaller than one window (data.seq_len = "
            f"{d.seq_len}); set data.token_budget to at least {d.seq_len}"
        )
    reread = reread_warning(cfg, num_windows)
    if reread:
        console.print(reread, markup=False)
    if _existing_is_current(out, fingerprint, force):
        console.print(f"{out}: already prepared (data fingerprint {fingerprint[:12]}); nothing to do")
        return out
    # resolving validates local paths before the slow tokenizer load; done once, a SlimPajama tree is large
    files = resolve_local_files(str(cfg.resolve_path(d.path)), d.hub_split, d.seed) if d.source == "local" else None
    source = describe_source(d, files)
    tok = load_tokenizer(cfg.resolve_source(d.tokenizer))
    encoder = text_encoder(tok)
    anchor = resolve_anchor(tok, d.anchor)
    anchor_id = anchor.id
    tags = None
    if d.domain_tags:
        tags = {i: np.array(encoder.encode(name), dtype=np.int32) for i, name in enumerate(DOMAINS)}
        longest = max(len(t) for t in tags.values())
        if d.seq_len < longest + 2:
            raise UserError(
                f"data.seq_len = {d.seq_len} cannot hold an anchor, a {longest}-token domain tag and "
                f"text; raise data.seq_len or set data.domain_tags=false"
            )
    workers = _num_workers(d.num_workers, num_windows * d.seq_len)

    tmp = out.parent / f".{out.name}.partial-{os.getpid()}"
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        _remove_stale(out)
        tmp.mkdir()
    except OSError as e:
        raise _write_error(out, e) from None
    console.print(
        f"preparing {out}: {source['kind']} source, tokenizer {d.tokenizer}, {num_windows:,} windows of "
        f"{d.seq_len:,} tokens, mixture {d.mixture}, {workers} worker(s)"
    )
    console.print(f"anchor: {anchor.token} (id {anchor.id}; {anchor.why})", markup=False)
    builder = None
    try:
        builder = _Builder(cfg, anchor_id, tags, tmp)
        t0 = time.perf_counter()
        read = _read(d, builder, _batches(d, files), encoder, workers, console)
        elapsed = time.perf_counter() - t0
        if builder.writer.num_windows == 0:
            # no manifest is written, so the skip table is never shown: say here why records were not usable
            skipped = ", ".join(f"{n:,} {reason}" for reason, n in read["skipped"]["counts"].items())
            raise UserError(
                f"the {source['kind']} source yielded {read['tokens']:,} tokens in {read['documents']:,} "
                f"usable documents{f' (skipped: {skipped})' if skipped else ''}, not enough for one "
                f"{d.seq_len:,}-token window; add data or lower data.seq_len"
            )
        shards = builder.writer.close()
        stats = builder.stats.to_dict(builder.mixture.target_shares())
        packed = builder.writer.num_windows * d.seq_len
        manifest = {
            "format_version": FORMAT_VERSION,
            "complete": True,
            "data_fingerprint": fingerprint,
            "config_fingerprint": config_fingerprint(cfg),
            "seq_len": d.seq_len,
            "num_windows": builder.writer.num_windows,
            "num_tokens": packed,
            "mixture": d.mixture,
            "token_budget": d.token_budget,
            "domain_tags": d.domain_tags,
            "interleave_chunks": d.interleave_chunks,
            "short_doc_tokens": d.short_doc_tokens,
            "down_sample_ratio": d.down_sample_ratio,
            "domains": list(DOMAINS),
            "tokenizer": _tokenizer_info(d.tokenizer, tok, encoder, anchor_id),
            "anchor": anchor.record(),
            "tags": {DOMAINS[i]: t.tolist() for i, t in tags.items()} if tags else None,
            "seed": d.seed,
            "shuffle": {"file_order": "seeded permutation", "buffer_tokens": builder.buffer.max_tokens},
            "stats": stats,
            "skipped": read["skipped"],
            "mixture_dropped": builder.mixture.dropped,
            "source": {
                **source,
                "records_read": read["records"],
                "documents_read": read["documents"],
                "tokens_read": read["tokens"],
            },
            "source_exhausted": read["exhausted"],
            "dropped_tail_tokens": read["tail"],
            "shards": shards,
            "build": {
                "seconds": round(elapsed, 3),
                "packed_tokens_per_s": round(packed / max(elapsed, 1e-9)),
                "tokenized_tokens_per_s": round(read["tokens"] / max(elapsed, 1e-9)),
                "num_workers": workers,
                "lctrain_version": __version__,
            },
        }
        write_resolved(cfg, tmp)
        write_manifest(tmp, manifest)
        _move_into_place(tmp, out)
    except BaseException as e:
        if builder is not None:
            with contextlib.suppress(OSError):  # closing the shard flushes it, which fails again on a full disk
                builder.writer.abort()
        shutil.rmtree(tmp, ignore_errors=True)
        if is_environment_error(e):
            raise _write_error(out, e) from None
        raise
    render(console, stats, read["skipped"])
    if read["exhausted"]:
        console.print(
            f"[yellow]the source ran out before the budget: {manifest['num_windows']:,} of "
            f"{num_windows:,} windows ({packed:,} tokens) written[/yellow]"
        )
    console.print(
        f"wrote {manifest['num_windows']:,} windows ({packed:,} tokens) to {out} in {elapsed:.1f} s "
        f"({manifest['build']['packed_tokens_per_s']:,} tokens/s)"
    )
    return out


def _read(d, builder: _Builder, batches, encoder, workers: int, console) -> dict:
    skips = _Skips(d.strict)
    records = documents = tokens = 0
    budget = builder.num_windows * d.seq_len
    t0 = time.perf_counter()
    with _progress(console) as bar:
        task = bar.add_task("prepare", total=budget, docs=0, docs_per_s=0.0)
        encoded = _encoded(batches, encoder, workers)
        for source, batch in encoded:
            for line, domain, ids, reason in batch:
                records += 1
                if reason is not None:
                    skips.add(reason, source, line)
                    continue
                if len(ids) < d.min_doc_tokens:
                    skips.add("too_short", source, line)
                    continue
                documents += 1
                tokens += len(ids)
                for item in builder.buffer.add((ids, domain), len(ids)):
                    builder.take(*item)
            bar.update(
                task,
                completed=builder.writer.num_windows * d.seq_len,
                docs=documents,
                docs_per_s=documents / max(time.perf_counter() - t0, 1e-9),
            )
            if builder.done:
                break
        encoded.close()  # stops the workers now when the budget is full before the source ends
        exhausted = not builder.done
        if exhausted:
            for item in builder.buffer.drain():
                builder.take(*item)
            exhausted = not builder.done
        bar.update(task, completed=builder.writer.num_windows * d.seq_len)
    return {
        "skipped": skips.to_dict(),
        "records": records,
        "documents": documents,
        "tokens": tokens,
        "exhausted": exhausted,
        "tail": builder.packer.filled if exhausted else 0,
    }
