"""What a mixture does with documents that do not fit it, and what `prepare` says about it: a document longer than
its source's token share has left is cut to fit (shares checked against token counts looped over the written
windows), a build the settings starved names the settings, not the input, and settings the mixture does not read are
refused."""

import json
import math

import pytest
from train_helpers import show_config_refusal

from lctrain.config import data_dir, load_config
from lctrain.data.prepare import prepare, settings_left_out
from lctrain.data.store import ShardWriter, open_packed
from lctrain.errors import UserError

SEQ_LEN, BUDGET = 256, 16384


def write(path, words: int, docs: int, name: str):
    """Written once: a file written again is other input (its modification time), which no build resumes from."""
    if not path.exists():
        path.write_text("".join(json.dumps({"text": f"{name}{i} " + "word " * words}) + "\n" for i in range(docs)))
    return path


def sources_cfg(tmp_path, sources: dict[str, tuple[int, int, str]], *extra):
    """`sources`: name -> (words per document, documents, `weight: ...` or `token_share: ...`)."""
    listed = ", ".join(
        f"{{name: {n}, path: '{write(tmp_path / f'{n}.jsonl', w, k, n)}', {key}}}" for n, (w, k, key) in sources.items()
    )
    return load_config(
        None,
        [
            f"data.sources=[{listed}]",
            f"data.seq_len={SEQ_LEN}",
            f"data.token_budget={BUDGET}",
            "data.shuffle_buffer_tokens=4096",
            f"data.output_dir={tmp_path / 'out'}",
            *extra,
        ],
    )


def counted(path) -> tuple[dict[str, int], dict[str, int]]:
    """(tokens, segments) per domain over every segment of every window."""
    data = open_packed(path)
    tokens, segments = {}, {}
    for i in range(len(data)):
        row = data[i]
        for n, dom in zip(row["seg_lens"], row["seg_domain"]):
            name = data.manifest.domains[int(dom)]
            tokens[name] = tokens.get(name, 0) + int(n)
            segments[name] = segments.get(name, 0) + 1
    return tokens, segments


def said(capsys) -> tuple[str, str]:
    """What prepare printed on stdout (its account of the build) and on stderr (its warnings and progress), each with
    its line breaks and runs of spaces as one space."""
    captured = capsys.readouterr()
    return " ".join(captured.out.split()), " ".join(captured.err.split())


SHARES = {"short": (12, 1500, "token_share: 0.9"), "book": (3000, 1, "token_share: 0.105")}
BOOK_SHARE = 0.105 / 1.005  # the shares sum to 1 within rounding, and are used as fractions of their sum


def test_a_document_longer_than_its_share_is_cut_to_fit(tmp_path, capsys):
    """One 3,000-word document against a 0.1 share of 16K tokens: whole, it would be 18% of the tokens."""
    path = prepare(sources_cfg(tmp_path, SHARES))
    tokens, segments = counted(path)
    total = sum(tokens.values())
    assert total == BUDGET
    assert tokens["book"] / total == pytest.approx(BOOK_SHARE, abs=0.001)
    # the book's head, up to its share: the share's tokens less its anchor, then one anchor per window it spans
    assert tokens["book"] - segments["book"] == math.ceil(BOOK_SHARE * BUDGET) - 1
    manifest = open_packed(path).manifest
    assert manifest.mixture_dropped["source_share_cut_tokens"] > 3000 - BOOK_SHARE * BUDGET
    out, err = said(capsys)
    assert "book token_share 0.1050 (0.1045 of their sum) -> 0.104" in out
    assert "missed" not in out and "missed" not in err


def test_an_interrupted_build_of_other_shares_is_said_to_be_discarded(tmp_path, capsys, monkeypatch):
    original = ShardWriter.add

    def failing_add(self, window):
        if self.num_windows == 8:
            raise RuntimeError("injected failure")
        return original(self, window)

    monkeypatch.setattr(ShardWriter, "add", failing_add)
    with pytest.raises(RuntimeError, match="injected"):
        prepare(sources_cfg(tmp_path, SHARES, "data.shard_tokens=1024"))
    monkeypatch.undo()
    capsys.readouterr()
    other = {**SHARES, "short": (12, 1500, "token_share: 0.8"), "book": (3000, 1, "token_share: 0.2")}
    prepare(sources_cfg(tmp_path, other, "data.shard_tokens=1024"))
    out, err = said(capsys)
    starting_over = (
        f"starting over: {tmp_path / '.out.partial'} holds an interrupted prepare of other settings, tokenizer or "
        f"input files (or shards changed since), which is discarded"
    )
    assert starting_over in err and starting_over not in out


def test_a_file_read_by_two_sources_is_named(tmp_path, capsys):
    web = write(tmp_path / "web.jsonl", 12, 1500, "web")
    cfg = sources_cfg(tmp_path, {"web": (12, 1500, "weight: 1"), "again": (12, 1500, "weight: 1")})
    cfg.data.sources[1].path = str(web)
    prepare(cfg)
    out, err = said(capsys)
    shared = (
        f"data.sources: 1 file(s) read by more than one source, whose documents are then used once per source: "
        f"{web} (web and again); list each file in one source"
    )
    assert shared in err and shared not in out


def test_a_build_starved_by_min_doc_tokens_and_share_caps_says_so(tmp_path, capsys):
    """No short document passes data.min_doc_tokens, so the long source's share fills and the rest is refused: the
    input did not run out, the settings emptied it."""
    cfg = sources_cfg(
        tmp_path,
        {"short": (12, 300, "token_share: 0.5"), "long": (400, 30, "token_share: 0.5")},
        "data.min_doc_tokens=100",
    )
    tokens, _ = counted(prepare(cfg))
    assert set(tokens) == {"long"} and tokens["long"] == BUDGET // 2
    out, err = said(capsys)
    warnings = [
        "the source ran out before the budget: 32 of 64 windows (8,192 tokens) written; the settings left out 300 "
        "documents shorter than data.min_doc_tokens = 100 (lower it); ",
        "documents of sources whose token_share was full while others' were not (lower the token_share",
        "data.sources missed the token_share of 2 source(s) by more than 1 percentage point (target -> achieved): "
        "short 50.0% -> 0.0%, long 50.0% -> 100.0%; the input ran out before the budget, with documents left out by "
        "the settings named above",
        # the re-read warning, here and in train's, which reads it from the manifest
        "with documents the data settings left out (prepare names them): add input data or let them in",
    ]
    for warning in warnings:
        assert warning in err and warning not in out, warning
    assert settings_left_out(open_packed(data_dir(cfg)).manifest)


def test_an_upsampled_build_starved_by_down_sampling_names_it(tmp_path, capsys):
    cfg = sources_cfg(
        tmp_path,
        {"web": (12, 300, "weight: 1"), "books": (400, 30, "weight: 1")},
        "data.mixture=upsampled",
        "data.domain_shares={web: 0.5, books: 0.5}",
        "data.short_doc_tokens=100",
        "data.down_sample_ratio=0",
    )
    tokens, _ = counted(prepare(cfg))
    assert set(tokens) == {"books"}
    out, err = said(capsys)
    warnings = [
        "the settings left out 300 documents down-sampled as shorter than data.short_doc_tokens = 100 (raise "
        "data.down_sample_ratio = 0 or lower data.short_doc_tokens); ",
        "web 50.0% -> 0.0%, books 50.0% -> 100.0%; the input ran out before the budget, with documents left out by "
        "the settings named above",
    ]
    for warning in warnings:
        assert warning in err and warning not in out, warning


def test_no_window_because_no_domain_has_a_share_names_the_domain(tmp_path):
    """A plain local file is all domain `other`, which the default upsampled shares leave out."""
    path = write(tmp_path / "plain.jsonl", 400, 3, "plain")
    cfg = load_config(
        None,
        [
            "data.source=local",
            f"data.path={path}",
            "data.mixture=upsampled",
            f"data.seq_len={SEQ_LEN}",
            f"data.output_dir={tmp_path / 'out'}",
        ],
    )
    with pytest.raises(UserError) as e:
        prepare(cfg)
    assert "and the settings left out 3 documents of domains without a share (other 3: give them one in " in str(
        e.value
    )
    assert "meta.redpajama_set_name): not one 256-token window was filled" in str(e.value)


@pytest.mark.parametrize(
    ("overrides", "needle"),
    [
        (["data.short_doc_tokens=2000"], "data.short_doc_tokens down-sample the short documents of mixture"),
        (
            ["data.down_sample_ratio=0.5", "data.short_doc_tokens=10"],
            "data.short_doc_tokens and data.down_sample_ratio down-sample the short documents of mixture 'upsampled' "
            "and are not read by the 'slimpajama' mixture: set data.mixture=upsampled, or leave them out",
        ),
    ],
)
def test_down_sampling_without_the_upsampled_mixture_is_refused(overrides, needle):
    assert needle in show_config_refusal(overrides)


def test_down_sampling_defaults_and_the_upsampled_mixture_load():
    load_config(None, ["data.short_doc_tokens=4096", "data.down_sample_ratio=0.1"])
    load_config(None, ["data.mixture=upsampled", "data.short_doc_tokens=2000", "data.down_sample_ratio=0.5"])
