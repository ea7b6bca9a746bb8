"""Stop token ids, stop strings, logprobs and penalties: every mode on tiny random models decides
as ``ar`` does (greedy tokens, seeded samples, logprobs bit for bit), a stop inside an accepted
draft cuts it where ``ar`` stops, and sampling with penalties follows the exact distribution."""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import grpc
import pytest
import torch

from client.grpc_client import GenerationClient, RequestOptions, build_request, response_to_json
from datastore_svc.store import LocalRetriever
from helpers.datastores import datastore_engine, dense_version, own_continuations, own_samples_engine
from helpers.models import FLAT_CURVE, DraftTally, prompts, tiny_model
from helpers.servers import ServerThread, tiny_worker
from helpers.stats import SAMPLES, VOCAB, chi_square_p, sample_counts
from llm_worker.config import ModelConfig, SamplingParams
from llm_worker.drafters.heads import HeadScore, HeadsFile, save_heads
from llm_worker.engine import Engine, GenerationRequest, InvalidRequestError, StepOutput
from llm_worker.model import wrap_model
from llm_worker.penalties import penalize
from llm_worker.results import GenerationResult
from llm_worker.sampling import warp_logits
from llm_worker.server import ServerConfig
from llm_worker.stopping import StopStrings, cut_at_stop, first_stop, visible_text
from llm_worker.textstream import TextStream
from llm_worker.types import DraftTree
from llm_worker.worker import WorkRequest
from specdraft.stubs import generation_pb2_grpc

MODES = ["pld", "pld:max_n=1", "pld+h:layer=1", "pld+a", "suffix", "recycle", "fuse", "rest"]
MODES += ["rest-batch", "dresd", "dresd-batch"]
"""Every registered mode that runs on a tiny random model without training a network (``glide``
and ``edd`` need one; they verify through the same steps)."""
NEW = 48
PENALTIES = SamplingParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.3)


def letters(ids: Sequence[int]) -> str:
    """A stand-in tokenizer: token t is two letters, so text positions map to tokens."""
    return "".join(chr(97 + t % 26) + chr(65 + t // 26) for t in ids)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[Any, Engine]:
    """A tiny Llama (fast backend) and an engine whose drafters have a sparse and dense
    datastore of its own continuations and an induction-head calibration."""
    tmp = tmp_path_factory.mktemp("features")
    model = tiny_model("llama", vocab=96)
    target = wrap_model(model, None, ModelConfig(backend="fast"))
    version = dense_version(model, target, tmp / "v", own_continuations(target))
    heads = save_heads(
        HeadsFile("tiny", "x", (HeadScore(1, 0, 0.9), HeadScore(1, 3, 0.5)), 10, 1), tmp / "h.json"
    )
    return model, datastore_engine(target, LocalRetriever(version), FLAT_CURVE, heads_file=heads)


def run(
    engine: Engine, prompt: Sequence[int], mode: str, **kw: Any
) -> tuple[GenerationResult, list[list[int]]]:
    """The result and each step's emitted tokens."""
    steps: list[list[int]] = []
    result = None
    for item in engine.stream(GenerationRequest(tuple(prompt), kw.pop("new", NEW), mode, **kw)):
        if isinstance(item, StepOutput):
            steps.append(item.token_ids)
        else:
            result = item
    assert result is not None
    return result, steps


# -- stop token ids and stop strings ------------------------------------------------------------


def test_a_stop_token_id_stops_every_mode_where_ar_stops(tiny: tuple[Any, Engine]) -> None:
    _, engine = tiny
    tally = DraftTally()
    for prompt in prompts(96):
        full, _ = run(engine, prompt, "ar", stop_at_eos=False)
        stop_id = full.token_ids[NEW // 2]
        cut = full.token_ids[: full.token_ids.index(stop_id) + 1]
        ref, _ = run(engine, prompt, "ar", stop_at_eos=False, stop_token_ids=(stop_id,))
        assert ref.token_ids == cut and ref.finish_reason == "stop" and ref.stop_reason == stop_id
        for mode in MODES:
            res, _ = run(engine, prompt, mode, stop_at_eos=False, stop_token_ids=(stop_id,))
            assert res.token_ids == cut, mode
            assert (res.finish_reason, res.stop_reason) == ("stop", stop_id), mode
            assert res.stats.new_tokens == len(cut), mode
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted("stop token id")


def spanning_stop(steps: list[list[int]]) -> tuple[str, int] | None:
    """A stop string that starts in one step's tokens and ends inside a later step that
    emitted at least 3 (a draft accepted), before that step's last token; with the number of
    tokens an output cut there holds. None if no step fits."""
    tokens = [t for s in steps for t in s]
    start = 0
    for before, step in itertools.pairwise(steps):
        start += len(before)
        if len(step) >= 3:
            end = start + 2  # the stop ends at the step's second token: mid-draft
            stop = letters(tokens[start - 1 : end])
            if letters(tokens[:end]).find(stop) == 2 * (start - 1):  # it occurs there first
                return stop, end
    return None


def test_a_stop_string_ending_inside_an_accepted_draft_cuts_it_where_ar_stops(
    tiny: tuple[Any, Engine],
) -> None:
    _, engine = tiny
    checked = set()
    for prompt, mode in itertools.product(prompts(96), MODES):
        free, steps = run(engine, prompt, mode, stop_at_eos=False)
        found = spanning_stop(steps)
        if found is None:
            continue
        stop, end = found
        strings = StopStrings((stop,), letters)
        ref, _ = run(engine, prompt, "ar", stop_at_eos=False, stop=strings)
        res, cut_steps = run(engine, prompt, mode, stop_at_eos=False, stop=strings)
        assert ref.token_ids == free.token_ids[:end], mode
        assert res.token_ids == ref.token_ids, mode
        assert (res.finish_reason, res.stop_reason) == ("stop", stop)
        assert cut_at_stop(letters(res.token_ids), (stop,)) == letters(res.token_ids[: end - 3])
        st = res.stats
        assert st.new_tokens == end == sum(len(s) for s in cut_steps)
        # the steps verified more tokens than were emitted (the prefill's, then each step's
        # accepted and bonus): the stop cut an accepted draft. Online drafters (suffix, recycle)
        # learned from the run before, so their steps may fall otherwise: counted, not asserted.
        if 1 + st.accepted_tokens + (st.target_forwards - 1) > st.new_tokens:
            checked.add(mode.split(":")[0])
    assert len(checked) >= 8, f"too few modes had a draft cut by the stop: {sorted(checked)}"


def test_stop_strings_match_across_tokens_and_characters() -> None:
    """Byte tokens: "é" is two of them; a window starting inside a character is not text."""

    def utf8(ids: Sequence[int]) -> str:
        return bytes(ids).decode("utf-8", errors="replace")

    text = "ab é! long tail é!?"
    ids = list(text.encode())
    strings = StopStrings(("é!?", "zz"), utf8)
    watch = strings.watch()
    hits = [i for i, t in enumerate(ids) if watch(t) is not None]
    assert hits[0] == len(ids) - 1 and strings.window == len("é!?".encode()) + 1
    assert first_stop("a.b!", (".", "!")) == (1, ".") and first_stop("ab", ("ab", "b")) == (0, "ab")
    assert cut_at_stop(text, ("é!?",)) == "ab é! long tail "
    for bad, message in [(("",), "empty"), (("a",) * 5, "at most 4"), (("x" * 300,), "at most 256")]:
        with pytest.raises(ValueError, match=message):
            StopStrings(bad, utf8)


def test_a_stream_never_shows_part_of_a_stop_string_it_cuts() -> None:
    assert visible_text("Hi\n", ("\n\n",), final=False) == "Hi"
    assert visible_text("Hi\n", ("\n\n",), final=True) == "Hi\n"
    assert visible_text("Hi\n\nBye", ("\n\n",), final=False) == "Hi"
    stream = TextStream(letters, ("cAdAeA",))  # tokens 2, 3, 4
    deltas = [stream.push([t]) for t in (0, 1, 2, 3, 2, 3, 4, 5)] + [stream.finish()]
    assert deltas == ["aA", "bA", "", "", "cAdA", "", "", "", ""]
    assert "".join(deltas) == cut_at_stop(letters([0, 1, 2, 3, 2, 3, 4, 5]), ("cAdAeA",))
    stream = TextStream(letters, ("cAdAeA",))
    assert [stream.push([t]) for t in (0, 2, 3)] + [stream.finish()] == ["aA", "", "", "cAdA"]


# -- logprobs -----------------------------------------------------------------------------------


def test_logprobs_are_bitwise_ars_in_every_mode_and_the_models_log_softmax(tiny: tuple[Any, Engine]) -> None:
    model, engine = tiny
    tally = DraftTally()
    for prompt in prompts(96)[:4]:
        ref, _ = run(engine, prompt, "ar", stop_at_eos=False, logprobs=5)
        assert ref.logprobs is not None and len(ref.logprobs) == len(ref.token_ids)
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + ref.token_ids[:-1]])).logits[0, len(prompt) - 1 :]
        expected = torch.log_softmax(logits.float(), -1)  # [new, vocab]
        for i, (lp, token) in enumerate(zip(ref.logprobs, ref.token_ids, strict=True)):
            assert lp.token_id == token and len(lp.top) == 5
            assert lp.logprob == pytest.approx(float(expected[i, token]), abs=1e-4)
            assert lp.top[0][0] == token  # greedy: the chosen token is the likeliest
        for mode in MODES:
            res, _ = run(engine, prompt, mode, stop_at_eos=False, logprobs=5)
            assert res.token_ids == ref.token_ids, mode
            assert res.logprobs == ref.logprobs, f"{mode}: logprobs differ from ar's"
            tally.observe(mode, res.stats)
        sampled = SamplingParams(temperature=0.8, seed=3)
        ref, _ = run(engine, prompt, "ar", stop_at_eos=False, logprobs=0, sampling=sampled)
        assert ref.logprobs is not None and all(not lp.top for lp in ref.logprobs)
        for mode in ("pld", "suffix", "rest-batch"):
            res, _ = run(engine, prompt, mode, stop_at_eos=False, logprobs=0, sampling=sampled)
            assert res.logprobs == ref.logprobs, mode
    tally.assert_every_mode_drafted_and_accepted("logprobs")
    assert run(engine, prompts(96)[0], "pld")[0].logprobs is None  # not asked: not computed


@pytest.mark.parametrize(
    "field,value,message",
    [
        ("logprobs", 21, "logprobs must be in [0, 20]"),
        ("logprobs", -1, "logprobs must be in [0, 20]"),
        ("stop_token_ids", (5, 96), "stop token id 96 is outside the vocabulary"),
        ("sampling", SamplingParams(presence_penalty=2.5), "presence_penalty must be in [-2, 2]"),
        ("sampling", SamplingParams(frequency_penalty=float("nan")), "frequency_penalty"),
        (
            "sampling",
            SamplingParams(repetition_penalty=0.0),
            "repetition_penalty must be a finite number > 0",
        ),
    ],
)
def test_the_engine_refuses_bad_values(
    tiny: tuple[Any, Engine], field: str, value: Any, message: str
) -> None:
    _, engine = tiny
    with pytest.raises(InvalidRequestError, match=message.replace("[", r"\[").replace("]", r"\]")):
        engine.validate(GenerationRequest((1, 2, 3), **{field: value}))


# -- penalties ----------------------------------------------------------------------------------


def test_penalize_follows_the_worked_example() -> None:
    logits = torch.zeros(10)
    logits[5], logits[7], logits[8] = 4.0, -1.0, 3.0
    params = SamplingParams(presence_penalty=0.25, frequency_penalty=0.5, repetition_penalty=2.0)
    out = penalize(logits, params, {5, 6}, {7: 2})
    assert (float(out[5]), float(out[7]), float(out[8])) == (2.0, -3.25, 3.0)
    assert float(out[6]) == 0.0 and float(out[0]) == 0.0  # 0 is not > 0: 0 · r
    assert DraftTree((5, 6, 7, 8), (-1, 0, 1, 0)).path(3) == [5, 8]


def reference_penalized(model: Any, prompt: list[int], params: SamplingParams, new: int) -> list[int]:
    """Plain greedy decoding with penalties written out per token, one full forward a token."""
    out: list[int] = []
    for _ in range(new):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + out])).logits[0, -1]
        row = logits.float().clone()  # [vocab], writable outside inference mode
        for t in set(prompt + out):
            row[t] = row[t] / params.repetition_penalty if row[t] > 0 else row[t] * params.repetition_penalty
        for t in set(out):
            row[t] -= params.frequency_penalty * out.count(t) + params.presence_penalty
        out.append(int(row.argmax()))
    return out


def test_greedy_with_penalties_every_mode_equals_ar(tiny: tuple[Any, Engine]) -> None:
    model, engine = tiny
    tally = DraftTally()
    for i, prompt in enumerate(prompts(96)):
        ref, _ = run(engine, prompt, "ar", stop_at_eos=False, sampling=PENALTIES)
        plain, _ = run(engine, prompt, "ar", stop_at_eos=False)
        assert ref.token_ids != plain.token_ids, "the penalties changed nothing: the test would prove nothing"
        if i < 2:
            assert ref.token_ids == reference_penalized(model, prompt, PENALTIES, NEW)
        for mode in MODES:
            res, _ = run(engine, prompt, mode, stop_at_eos=False, sampling=PENALTIES)
            assert res.token_ids == ref.token_ids, f"{mode}/prompt {i}: differs from ar with penalties"
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted("penalties")


def test_seeded_sampling_with_penalties_every_mode_equals_ar(tiny: tuple[Any, Engine]) -> None:
    _, engine = tiny
    tally = DraftTally()
    for seed, prompt in enumerate(prompts(96)[:4]):
        params = SamplingParams(
            0.5, 0.95, 0, seed, presence_penalty=0.5, frequency_penalty=0.2, repetition_penalty=1.2
        )
        ref, _ = run(engine, prompt, "ar", stop_at_eos=False, sampling=params)
        for mode in MODES:
            res, _ = run(engine, prompt, mode, stop_at_eos=False, sampling=params)
            assert res.token_ids == ref.token_ids, f"{mode}/seed {seed}"
            tally.observe(mode, res.stats)
    tally.assert_every_mode_drafted_and_accepted("sampled penalties")


def penalized_distribution(
    model: Any, prompt: list[int], params: SamplingParams, new: int = 3
) -> dict[tuple[int, ...], float]:
    """P(continuation) of every ``new``-token continuation with penalties, by enumeration: each
    position's row penalised by the prompt and the continuation's tokens before it."""
    dist = {}
    for seq in itertools.product(range(VOCAB), repeat=new):
        with torch.inference_mode():
            logits = model(torch.tensor([prompt + list(seq[:-1])])).logits[0, len(prompt) - 1 :]
        p = 1.0
        for i, tok in enumerate(seq):
            before = list(seq[:i])
            row = penalize(logits[i], params, set(prompt), {t: before.count(t) for t in before})
            p *= float(warp_logits(row[None], params)[0, tok])
        dist[seq] = p
    return dist


@pytest.mark.parametrize(
    "params,modes",
    [
        (
            SamplingParams(
                temperature=1.0, presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.5
            ),
            ("ar", "pld", "rest-batch"),
        ),
        (
            SamplingParams(
                temperature=0.8, top_k=5, top_p=0.9, frequency_penalty=-0.5, repetition_penalty=0.7
            ),
            ("suffix", "rest", "rest-batch"),
        ),
    ],
    ids=["t1-all", "t0.8-k5-p0.9-negative"],
)
def test_sampling_with_penalties_matches_the_exact_distribution(
    params: SamplingParams, modes: tuple[str, ...], tmp_path: Path
) -> None:
    """A chain, a tree and a batch's trie (and ``ar``, which checks the enumeration) against
    the penalised distribution; the seeded test above carries it to every mode."""
    model, engine, prompt = own_samples_engine(tmp_path, params)
    dist = penalized_distribution(model, prompt, params)
    for mode in modes:
        counts, drafted, accepted = sample_counts(engine, prompt, mode, params)
        p = chi_square_p(counts, dist, SAMPLES)
        assert p > 1e-3, f"{mode}: penalised samples do not follow the exact distribution (p = {p:.2g})"
        if mode != "ar":
            assert drafted > SAMPLES // 4 and accepted > 0, f"{mode}: the test would prove nothing"


# -- through a worker's gRPC server ---------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tiny_dir: Path) -> Iterator[ServerThread]:
    """A worker of a tiny random Llama with the real tokenizer (byte-level BPE), on loopback."""
    srv = ServerThread(tiny_worker(tiny_dir, "w-features"), ServerConfig(port=0))
    yield srv
    srv.stop()


PROMPT = "hello world hello world hello"


def test_stop_strings_ids_logprobs_and_penalties_round_trip_over_grpc(server: ServerThread) -> None:
    worker = server.server.worker
    with GenerationClient([server.address]) as client:
        full = client.generate(
            build_request(text=PROMPT, options=RequestOptions(mode="pld", max_new_tokens=40))
        )
        text = full.text
        pieces = (text[i : i + 3] for i in range(len(text) // 2, len(text) - 3))
        stop = next(p for p in pieces if p.strip() and "\ufffd" not in p)  # text, not a broken byte
        options = RequestOptions(mode="pld", max_new_tokens=40, stop=(stop, "never in it"), logprobs=3)
        unary = client.generate(build_request(text=PROMPT, options=options))
        chunks = list(client.generate_stream(build_request(text=PROMPT, options=options)))
        stop_id = full.token_ids[10]
        by_id = client.generate(
            build_request(text=PROMPT, options=RequestOptions(max_new_tokens=40, stop_token_ids=(stop_id,)))
        )
        penalised = RequestOptions(
            mode="pld",
            max_new_tokens=24,
            presence_penalty=0.5,
            frequency_penalty=0.25,
            repetition_penalty=1.25,
        )
        pen = client.generate(build_request(text=PROMPT, options=penalised))
    assert unary.text == text[: text.find(stop)] and unary.finish_reason == "stop"
    assert unary.WhichOneof("stop_reason") == "stop_string" and unary.stop_string == stop
    assert list(unary.token_ids) == list(full.token_ids[: len(unary.token_ids)])
    assert stop in worker.decode(unary.token_ids) and stop not in worker.decode(unary.token_ids[:-1])
    assert chunks[-1].final.text == unary.text
    assert "".join(c.text for c in chunks) == unary.text  # the deltas never showed the stop string
    ids = tuple(worker.encode(WorkRequest(text=PROMPT)))
    local = worker.engine.generate(GenerationRequest(ids, 40, "ar", logprobs=3))
    n = len(unary.token_ids)
    assert [
        (lp.token_id, lp.logprob, [(t.token_id, t.logprob) for t in lp.top]) for lp in unary.logprobs
    ] == [(lp.token_id, lp.logprob, list(lp.top)) for lp in (local.logprobs or [])[:n]]
    as_json = response_to_json(unary)
    assert as_json["stop_reason"] == stop and len(as_json["logprobs"]) == n
    assert as_json["logprobs"][0]["top"][0]["token_id"] == unary.token_ids[0]
    first = list(full.token_ids).index(stop_id)
    assert list(by_id.token_ids) == list(full.token_ids[: first + 1]) and by_id.stop_token_id == stop_id
    assert response_to_json(by_id)["stop_reason"] == stop_id and "logprobs" not in response_to_json(by_id)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25, repetition_penalty=1.25)
    assert list(pen.token_ids) == worker.engine.generate(GenerationRequest(ids, 24, "ar", params)).token_ids


def options_request(**fields: Any) -> Any:
    return build_request(text="hi", options=RequestOptions(max_new_tokens=4, **fields))


BAD = {
    "five stop strings": (options_request(stop=("a", "b", "c", "d", "e")), "at most 4 stop strings, got 5"),
    "empty stop string": (options_request(stop=("",)), "a stop string is empty"),
    "long stop string": (options_request(stop=("x" * 257,)), "a stop string has 257 characters; at most 256"),
    "stop token id": (
        options_request(stop_token_ids=(10**6,)),
        "stop token id 1000000 is outside the vocabulary",
    ),
    "logprobs": (options_request(logprobs=21), "logprobs must be in [0, 20], got 21"),
    "presence": (options_request(presence_penalty=2.5), "presence_penalty must be in [-2, 2], got 2.5"),
    "frequency": (options_request(frequency_penalty=-3.0), "frequency_penalty must be in [-2, 2], got -3.0"),
    "repetition": (
        options_request(repetition_penalty=-1.0),
        "repetition_penalty must be a finite number > 0",
    ),
}


@pytest.mark.parametrize("case", list(BAD))
def test_bad_values_are_invalid_argument_with_a_precise_message(server: ServerThread, case: str) -> None:
    request, message = BAD[case]
    with grpc.insecure_channel(server.address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        with pytest.raises(grpc.RpcError) as err:
            stub.Generate(request, timeout=30)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, case
    assert message in err.value.details(), err.value.details()
