"""The offline RULER-style task generators: deterministic, the answers really sit in the haystack at the stated depth,
prompts fit the length with the real tokenizer; qa_1 from a SQuAD file and qa_2 from a HotpotQA file; bad input is a
UserError."""

import json
import re
from collections import Counter

import pytest

from lctrain.errors import UserError
from lctrain.eval import tasks
from lctrain.eval.filler import KEY_ADJECTIVES, KEY_NOUNS
from lctrain.eval.tasks import FWE_NOISE, fit_units, generate, load_qa, task_specs, unscorable_qa, zipf_counts
from lctrain.tokenizer import load_tokenizer

LENGTH = 768
N = 3


@pytest.fixture(scope="module")
def count():
    tok = load_tokenizer("builtin:mistral-7b-v0.1")
    return lambda text: len(tok(text)["input_ids"])


@pytest.fixture(scope="module")
def samples(count):
    return {name: generate(spec, LENGTH, N, 7, count) for name, spec in task_specs(7).items()}


def test_deterministic_and_seed_dependent(samples, count):
    again = generate(task_specs(7)["niah_single_2"], LENGTH, N, 7, count)
    assert [s.prompt for s in again] == [s.prompt for s in samples["niah_single_2"]]
    other = generate(task_specs(8)["niah_single_2"], LENGTH, N, 8, count)
    assert [s.answers for s in other] != [s.answers for s in samples["niah_single_2"]]


def test_prompts_fit_and_fill_the_length(samples, count):
    for name, ss in samples.items():
        for s in ss:
            budget = LENGTH - s.max_new_tokens
            assert count(s.prompt) == s.num_tokens <= budget, name
            assert s.num_tokens > 0.85 * budget, f"{name}: haystack too short ({s.num_tokens} of {budget})"


def test_needles_present_at_their_depth(samples):
    for name in [t for t in samples if t.startswith("niah")] + ["vt"]:
        for s in samples[name]:
            # the haystack is what lies between the instruction and the question
            body = s.prompt.split("\n\n")[1]
            for needle, depth in s.needles:
                assert body.count(needle) == 1, (name, needle)
                # depth is relative to the haystack proper: the other needles are not part of it
                alone = body
                for other, _ in s.needles:
                    if other != needle:
                        alone = alone.replace(other, "")
                where = alone.index(needle) / (len(alone) - len(needle))
                units = len(re.findall(r"\.\s", alone)) + 1  # needles sit between sentences/lines
                assert abs(where - depth) <= max(0.05, 1.5 / units), (name, where, depth)
            for answer in s.answers:
                assert answer in body, (name, answer)
        first_depths = [s.needles[0][1] for s in samples[name]]
        assert first_depths == pytest.approx([(i + 0.5) / N for i in range(N)])


def test_single_needle_answer_is_the_queried_value(samples):
    for s in samples["niah_single_1"]:
        needle = s.needles[0][0]
        key = re.search(r"for (\S+) is", needle).group(1)
        assert s.answers == (needle.rsplit(" ", 1)[1].rstrip("."),)
        assert s.prompt.rstrip().endswith(f"for {key} mentioned in the text above is")
    for s in samples["niah_multiquery"]:
        assert len(s.answers) == 4 and all(a in s.prompt for a in s.answers)
    for s in samples["niah_multivalue"]:
        assert len(set(s.answers)) == 4


def test_variable_tracking_chain_resolves_to_answers(samples):
    for s in samples["vt"]:
        body = s.prompt.split("\n\n")[1]
        value = re.search(r"assigned the value (\d+) in the text", s.prompt).group(1)
        assigned = {a: b for a, b in re.findall(r"VAR (\w+) = ([\w ]+?)\.", body)}
        resolved = set()
        for var in assigned:
            v = var
            while assigned[v].startswith("VAR "):
                v = assigned[v][4:]
            if assigned[v] == value:
                resolved.add(var)
        assert resolved == set(s.answers)


def _frequencies(words):
    freq = {}
    for w in words:
        freq[w] = freq.get(w, 0) + 1
    return freq


def test_cwe_answers_the_most_frequent_with_rulers_repeats(samples, count):
    # RULER: 10 words x 30 and the others x 3 from 4096 tokens on, x 6 and x 1 below
    for length, ss, (common, rare) in ((LENGTH, samples["cwe"], (6, 1)), (4096, None, (30, 3))):
        for s in ss or generate(task_specs(7)["cwe"], length, 2, 7, count):
            freq = _frequencies(re.findall(r"\d+\. (\w+)", s.prompt.split("\n\n")[1]))
            assert len(s.answers) == 10 and {freq[a] for a in s.answers} == {common}, length
            assert {f for w, f in freq.items() if w not in s.answers} == {rare}, length


def test_fwe_answers_ranks_two_to_four_after_the_dots(samples):
    # RULER: the top rank is noise (the dots), the answer the next three words
    for s in samples["fwe"]:
        freq = _frequencies(s.prompt.split("\n\n")[1].split())
        ranked = sorted(freq, key=freq.get, reverse=True)
        assert ranked[0] == FWE_NOISE and freq[FWE_NOISE] > 0.5 * sum(freq.values())
        assert tuple(ranked[1:4]) == s.answers
        assert freq[ranked[0]] > freq[ranked[1]] > freq[ranked[2]] > freq[ranked[3]] > freq[ranked[4]]


def test_zipf_counts_strictly_ranked():
    # fwe's answer needs ranks 1 (the dots) to 5 strictly ordered, down to its smallest haystack (40 words)
    for total in range(40, 5000):
        c = zipf_counts(total)
        assert c[0] > c[1] > c[2] > c[3] > c[4], total
    for total in (5000, 200_000):
        c = zipf_counts(total)
        assert abs(sum(c) - total) < 0.05 * total
        # rank^-2: the first count is the others' multiples by the squared rank, to rounding
        assert all(abs(c[0] / (r + 1) ** 2 - c[r]) <= 1 for r in range(len(c))), total


def test_fit_units_against_linear_search():
    def cost(n):
        return 10 + 3 * n

    for budget in (9, 10, 12, 13, 100, 1001):
        expected = max([n for n in range(400) if cost(n) <= budget], default=-1)
        assert fit_units(cost, budget) == expected
    assert fit_units(cost, 1000, max_units=50) == 50


def test_too_short_length_is_a_user_error(count):
    with pytest.raises(UserError, match="too short for task niah_multikey_1"):
        generate(task_specs(0)["niah_multikey_1"], 200, 1, 0, count)


def test_every_generated_task_is_rulers_and_qa_needs_its_file():
    rulers_13 = [
        "niah_single_1",
        "niah_single_2",
        "niah_single_3",
        "niah_multikey_1",
        "niah_multikey_2",
        "niah_multikey_3",
        "niah_multivalue",
        "niah_multiquery",
        "vt",
        "cwe",
        "fwe",
        "qa_1",
        "qa_2",
    ]
    assert list(task_specs(0)) == rulers_13[:-2]
    # RULER's scripts/data/synthetic/constants.py: tokens_to_generate per base task
    expected = {"vt": 30, "cwe": 120, "fwe": 50, **{t: 128 for t in rulers_13[:8]}}
    assert {n: s.max_new_tokens for n, s in task_specs(0).items()} == expected
    missing = unscorable_qa(rulers_13, {"qa_1": None, "qa_2": "h.json"})
    assert list(missing) == ["qa_1"] and "--squad FILE" in missing["qa_1"]
    assert unscorable_qa(["vt"], {}) == {}


def _squad(tmp_path):
    data = {
        "data": [
            {
                "title": f"t{i}",
                "paragraphs": [
                    {
                        "context": f"Paragraph {i}: the river town number {i} was founded by settler {i * 7}.",
                        "qas": [
                            {"question": f"Who founded town {i}?", "answers": [{"text": f"settler {i * 7}"}]},
                            {"question": "unanswerable?", "answers": [], "is_impossible": True},
                        ],
                    }
                ],
            }
            for i in range(30)
        ]
    }
    p = tmp_path / "squad.json"
    p.write_text(json.dumps(data))
    return p


def _hotpot(tmp_path):
    hotpot = [
        {
            "question": f"q{i}?",
            "answer": f"a{i}",
            "supporting_facts": [[f"T{i}", 0]],
            "context": [[f"T{i}", [f"Fact {i} is a{i}."]], [f"U{i}", ["Noise."]]],
        }
        for i in range(5)
    ]
    p = tmp_path / "hotpot.json"
    p.write_text(json.dumps(hotpot))
    return p


def test_qa_squad_and_hotpot(tmp_path, count):
    qa = load_qa(_squad(tmp_path), "qa_1")
    assert qa.format == "squad" and len(qa.items) == 30 and len(qa.documents) == 30
    hq = load_qa(_hotpot(tmp_path), "qa_2")
    assert hq.format == "hotpotqa" and hq.items[2].gold == ("Fact 2 is a2.",)
    specs = task_specs(0, {"qa_1": qa, "qa_2": hq})
    assert list(specs)[-2:] == ["qa_1", "qa_2"]
    for task, data in (("qa_1", qa), ("qa_2", hq)):
        for s in generate(specs[task], 512, 2, 0, count):
            item = next(it for it in data.items if f"Question: {it.question}" in s.prompt)
            assert s.metric == "part" and s.max_new_tokens == 32
            assert s.answers == item.answers and item.gold[0] in s.prompt and s.num_tokens <= 512 - 32


def test_qa_bad_files(tmp_path):
    with pytest.raises(UserError, match="cannot read the qa_1 file"):
        load_qa(tmp_path / "missing.json", "qa_1")
    with pytest.raises(UserError, match="a HotpotQA file, but qa_1 is RULER's SQuAD task"):
        load_qa(_hotpot(tmp_path), "qa_1")
    with pytest.raises(UserError, match="a SQuAD file, but qa_2 is RULER's HotpotQA task"):
        load_qa(_squad(tmp_path), "qa_2")
    bad = tmp_path / "bad.json"
    bad.write_text("{not json")
    with pytest.raises(UserError, match="not valid JSON"):
        load_qa(bad, "qa_1")
    bad.write_text(json.dumps([{"question": "q?", "context": [["T", ["Fact."]]]}]))  # a test split: no answer
    with pytest.raises(UserError, match="malformed HotpotQA entry"):
        load_qa(bad, "qa_2")
    bad.write_text(json.dumps({"data": [{"paragraphs": [{"context": "c", "qas": [{"answers": [{"text": "a"}]}]}]}]}))
    with pytest.raises(UserError, match="malformed SQuAD entry"):
        load_qa(bad, "qa_1")
    bad.write_text(json.dumps({"rows": []}))
    with pytest.raises(UserError, match="neither SQuAD"):
        load_qa(bad, "qa_1")


# ---------------------------------------------------------------- niah keys


def _check_niah_keys(s):
    """By a plain parse of the haystack: the needle keys are distinct (niah_multivalue: its one key 4 times, with 4
    distinct values), each queried key occurs exactly once per value, the answers are the queried keys' values and
    no other key shares a word with a queried key."""
    body = s.prompt.split("\n\n")[1]
    found = re.findall(r"One of the special magic \w+ for (\S+) is: (\S+)\.", body)
    keys = Counter(k for k, _ in found)
    asked = re.search(r"magic \w+ for (.+?) mentioned in the text above\?", s.prompt).group(1)
    queried = asked.replace(" and ", ", ").split(", ")
    per_key = 4 if s.task == "niah_multivalue" else 1
    assert len(queried) == (4 if s.task == "niah_multiquery" else 1), asked
    assert all(n == 1 for k, n in keys.items() if k not in queried), (s.task, s.length, keys.most_common(2))
    values = []
    for q in queried:
        assert keys[q] == per_key and body.count(f" for {q} is: ") == per_key, (s.task, s.length, q)
        values += [v for k, v in found if k == q]
    assert sorted(values) == sorted(s.answers) and len(set(values)) == len(values)
    if s.task != "niah_multikey_3":  # word keys
        words = {w for q in queried for w in q.split("-")}
        assert not [k for k in keys if k not in queried and words & set(k.split("-"))], (s.task, s.length)
    return len(found)


NIAH = [t for t in task_specs(0) if t.startswith("niah")]


def test_cheap_token_count_is_a_lower_bound(samples, count):
    # the fast key test counts a token per 6 characters: fewer tokens than a real tokenizer's, so more haystack
    for name, ss in samples.items():
        for s in ss:
            assert count(s.prompt) >= len(s.prompt) / 6, name


@pytest.mark.parametrize("task", NIAH)
def test_niah_keys_distinct_and_queried_once_up_to_128k(task):
    spec = task_specs(3)[task]
    for length in (4096, 8192, 16384, 32768, 65536, 131072):
        needles = [_check_niah_keys(s) for s in generate(spec, length, 2, 3, lambda t: len(t) // 6)]
    if task == "niah_multikey_2":
        assert min(needles) > 10_000  # at 128K: about twice the 5,394 of Mistral's tokenizer


@pytest.mark.slow
def test_niah_keys_with_a_real_tokenizer_up_to_128k(count):
    for task in NIAH:
        for length in (4096, 16384, 65536, 131072):
            for s in generate(task_specs(5)[task], length, 3, 5, count):
                _check_niah_keys(s)


def test_key_words_make_no_key_a_substring_of_another():
    for words in (KEY_ADJECTIVES, KEY_NOUNS):
        assert len(set(words)) == len(words) and all(w.isalpha() and w.islower() for w in words)
    assert not set(KEY_ADJECTIVES) & set(KEY_NOUNS)
    # "<adjective>-<noun>" is inside another key only if an adjective ends another one or a noun begins another one
    assert not [(a, b) for a in KEY_ADJECTIVES for b in KEY_ADJECTIVES if a != b and b.endswith(a)]
    assert not [(a, b) for a in KEY_NOUNS for b in KEY_NOUNS if a != b and b.startswith(a)]
    assert len(KEY_ADJECTIVES) * len(KEY_NOUNS) > 80_000


def test_distractor_keys_run_out_in_one_line(monkeypatch, count):
    # 4 adjectives x 5 nouns: the queried key's words leave 3 x 4 = 12 distractor keys
    monkeypatch.setattr(tasks, "KEY_ADJECTIVES", KEY_ADJECTIVES[:4])
    monkeypatch.setattr(tasks, "KEY_NOUNS", KEY_NOUNS[:5])
    spec = task_specs(0)["niah_multikey_2"]
    assert spec.max_units == 12
    with pytest.raises(UserError, match="too long for task niah_multikey_2: its haystack holds at most 12 ") as e:
        generate(spec, 1024, 1, 0, count)
    most = int(re.search(r"about ([\d,]+) tokens", str(e.value)).group(1).replace(",", ""))
    assert 400 < most < 0.98 * 1024  # 13 needles of about 22 tokens, the question and 128 to generate
    (s,) = generate(spec, 400, 1, 0, count)  # a length the keys can fill
    assert 5 < _check_niah_keys(s) < 13
