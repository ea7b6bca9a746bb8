"""The Python API (``from specdraft import LLM, SamplingParams``) and the gRPC client's text-level
``complete``: outputs equal to the engine's, the prompt as the chat options render it, refusals."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from client.api import LLM, SamplingParams, work_request
from client.grpc_client import GenerationClient
from helpers.models import CPU_LIKE_CURVE
from helpers.servers import ServerThread
from llm_worker.chat import chat_prompt_ids, prompt_ids
from llm_worker.config import EngineConfig, ModelConfig
from llm_worker.drafters import UnknownModeError
from llm_worker.engine import Engine, GenerationRequest
from llm_worker.model import load_target
from llm_worker.server import ServerConfig
from llm_worker.worker import Worker

ROOT = Path(__file__).resolve().parent.parent
TEMPLATE = "{% for m in messages %}[{{ m.role }}] {{ m.content }}\n{% endfor %}[assistant]"
"""A chat template unlike the tokenizer's own: its prompt's ids tell which one rendered it."""
SYSTEM = "You answer in one short sentence."
USER = [{"role": "user", "content": "Name a prime number."}]


@pytest.fixture(scope="module")
def llm(tiny_dir: Path) -> LLM:
    """An LLM of the tiny model whose engine prices drafts by a fixed curve: on a loaded machine
    the measured one is measured again and again (seconds each), which these tests do not test."""
    llm = LLM(str(tiny_dir))
    engine = Engine(llm.worker.engine.target, EngineConfig(), curve=CPU_LIKE_CURVE)
    llm.worker = Worker(engine, llm.worker.tokenizer)
    return llm


def test_import_specdraft_loads_no_torch_and_exports_the_api_lazily() -> None:
    code = (
        "import sys, specdraft\n"
        "assert 'torch' not in sys.modules and 'client' not in sys.modules, sorted(sys.modules)\n"
        "from specdraft import LLM, SamplingParams\n"
        "assert LLM.__module__ == SamplingParams.__module__ == 'client.api'\n"
    )
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr


def test_generate_returns_the_engines_tokens_and_text(llm: LLM) -> None:
    tokenizer = llm.worker.tokenizer
    prompts = ["hello hello hello", "one two three one two"]
    outs = llm.generate(prompts, SamplingParams(max_tokens=12))
    assert [o.prompt for o in outs] == prompts
    for prompt, out in zip(prompts, outs, strict=True):
        ids = prompt_ids(tokenizer, prompt)
        reference = llm.worker.engine.generate(GenerationRequest(tuple(ids), 12))
        assert out.prompt_token_ids == ids
        assert out.outputs[0].token_ids == reference.token_ids
        assert out.outputs[0].text == tokenizer.decode(reference.token_ids, skip_special_tokens=True)
        assert out.outputs[0].finish_reason == reference.finish_reason
        assert out.mode == "ar" and out.stats.tau == 1.0 and out.stats.new_tokens == len(reference.token_ids)
        assert out.to_json()["token_ids"] == reference.token_ids


def test_a_per_call_mode_gives_the_same_tokens_with_its_statistics(llm: LLM) -> None:
    prompt = "a b c d a b c d a b c d a b"
    params = [SamplingParams(max_tokens=16), SamplingParams(max_tokens=16, temperature=0.8, seed=7)]
    ar = llm.generate([prompt, prompt], params)
    pld = llm.generate([prompt, prompt], params, mode="pld")
    assert [o.outputs[0].token_ids for o in pld] == [o.outputs[0].token_ids for o in ar]
    assert all(o.mode == "pld" and o.stats.tau >= 1.0 for o in pld)
    assert pld[0].stats.drafted_tokens >= pld[0].stats.accepted_tokens >= 0
    assert llm.mode == "ar"  # the LLM's own mode is unchanged


def test_chat_renders_the_system_prompt(llm: LLM) -> None:
    tokenizer = llm.worker.tokenizer
    plain, with_system = llm.chat(USER, SamplingParams(max_tokens=4)) + llm.chat(
        [USER], SamplingParams(max_tokens=4), system_prompt=SYSTEM
    )
    assert plain.prompt_token_ids == chat_prompt_ids(tokenizer, USER)
    system_turn = [{"role": "system", "content": SYSTEM}]
    assert with_system.prompt_token_ids == chat_prompt_ids(tokenizer, system_turn + USER)
    assert SYSTEM in with_system.prompt and SYSTEM not in plain.prompt
    own = [{"role": "system", "content": "Be brief."}, *USER]  # a conversation's own system turn stays
    assert llm.chat(own, SamplingParams(max_tokens=1), system_prompt=SYSTEM)[0].prompt_token_ids == (
        chat_prompt_ids(tokenizer, own)
    )


def test_a_chat_template_and_a_context_cap(tiny_dir: Path) -> None:
    llm = LLM(str(tiny_dir), chat_template=TEMPLATE, max_model_len=48)
    out = llm.chat(USER, SamplingParams(max_tokens=4))[0]
    expected = llm.worker.tokenizer("[user] Name a prime number.\n[assistant]", add_special_tokens=False)
    assert out.prompt_token_ids == list(expected["input_ids"])
    assert llm.worker.model_info.max_context == 48
    with pytest.raises(ValueError, match="exceeds the model's context of 48 tokens"):
        llm.generate("hello", SamplingParams(max_tokens=48))


def test_a_chat_template_that_does_not_render_is_refused_at_start(tiny_dir: Path) -> None:
    with pytest.raises(ValueError, match="chat template does not render"):
        LLM(str(tiny_dir), chat_template="{% for m in messages %}")


def test_a_mistyped_mode_is_refused_before_the_model_loads() -> None:
    with pytest.raises(UnknownModeError, match="unknown mode 'pdl'"):
        LLM("/nonexistent/model", mode="pdl")
    with pytest.raises(UnknownModeError, match="takes options"):
        LLM("/nonexistent/model", mode="pld+h:layr=3")


def test_stops_logprobs_and_penalties_reach_the_engine(llm: LLM) -> None:
    """Each mode stops where ``ar`` stops, on a stop string cut out of ``ar``'s own text (ending
    mid-output, so a draft may cross it), with ``ar``'s logprobs bit for bit; penalties as ``ar``."""
    ar = llm.generate("Count: one two three", SamplingParams(max_tokens=24, ignore_eos=True))[0]
    text = ar.outputs[0].text
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    assert stop.strip(), text
    params = SamplingParams(max_tokens=24, ignore_eos=True, stop=stop, logprobs=2, repetition_penalty=1.2)
    ref = llm.generate("Count: one two three", params)[0].outputs[0]
    assert ref.finish_reason == "stop" and ref.stop_reason == stop and stop not in ref.text
    assert ref.logprobs is not None and len(ref.logprobs) == len(ref.token_ids)
    assert all(len(lp.top) == 2 for lp in ref.logprobs)
    for mode in ("pld", "suffix"):
        got = llm.generate("Count: one two three", params, mode=mode)[0].outputs[0]
        assert (got.token_ids, got.text, got.logprobs) == (ref.token_ids, ref.text, ref.logprobs), mode


def test_the_worker_checks_request_feature_values() -> None:
    req = work_request(SamplingParams(stop="END", stop_token_ids=[2], logprobs=3), "ar", text="hi")
    assert (req.stop, req.stop_token_ids, req.logprobs) == (("END",), (2,), 3)
    req = work_request(SamplingParams(presence_penalty=0.5, repetition_penalty=1.1), "ar", text="hi")
    assert (req.sampling.presence_penalty, req.sampling.repetition_penalty) == (0.5, 1.1)


def test_the_mapping_of_sampling_params() -> None:
    params = SamplingParams(temperature=0.7, top_p=0.9, top_k=-1, seed=3, max_tokens=9, ignore_eos=True)
    req = work_request(params, "pld", chat=USER, tenant="t")
    assert req.chat == (("user", "Name a prime number."),) and req.text is None
    assert (req.mode, req.max_new_tokens, req.ignore_eos, req.tenant) == ("pld", 9, True, "t")
    sampling = req.sampling
    assert (sampling.temperature, sampling.top_p, sampling.top_k, sampling.seed) == (0.7, 0.9, 0, 3)
    assert work_request(SamplingParams(stop=[], stop_token_ids=()), "ar", text="x").text == "x"
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        work_request(SamplingParams(max_tokens=0), "ar", text="x")


@pytest.fixture(scope="module")
def served(tiny_dir: Path) -> Iterator[ServerThread]:
    """A worker of the tiny model on loopback, rendering chats with ``TEMPLATE``."""
    target, tokenizer = load_target(ModelConfig(path=str(tiny_dir)))
    engine = Engine(target, EngineConfig(), curve=CPU_LIKE_CURVE)
    worker = Worker(engine, tokenizer, worker_id="api-test", chat_template=TEMPLATE)
    server = ServerThread(worker, ServerConfig(port=0))
    yield server
    server.stop()


def test_complete_over_grpc_equals_the_llm(llm: LLM, served: ServerThread) -> None:
    prompt = "one two three one two"
    local = llm.generate(prompt, SamplingParams(max_tokens=10))[0]
    with GenerationClient([served.address], timeout=60) as client:
        remote = client.complete(prompt, mode="pld", max_new_tokens=10)
        chat = client.complete(USER, max_new_tokens=3, system_prompt=SYSTEM)
        with pytest.raises(ValueError, match="system_prompt applies to a chat"):
            client.complete("text", system_prompt=SYSTEM)
    assert remote.token_ids == local.outputs[0].token_ids and remote.text == local.outputs[0].text
    assert remote.mode == "pld" and remote.stats.tau >= 1.0 and remote.worker_id == "api-test"
    assert remote.prompt_tokens == len(local.prompt_token_ids)
    rendered = f"[system] {SYSTEM}\n[user] Name a prime number.\n[assistant]"  # the worker's template
    assert chat.prompt_tokens == len(llm.worker.tokenizer(rendered, add_special_tokens=False)["input_ids"])


@pytest.mark.slow
def test_the_default_model_answers_a_chat_without_special_tokens_in_its_text() -> None:
    llm = LLM(mode="pld")
    messages = [{"role": "user", "content": "Say hello in one short sentence."}]
    out = llm.chat(messages, SamplingParams(max_tokens=128))[0].outputs[0]
    assert out.finish_reason == "stop" and out.token_ids[-1] == llm.worker.tokenizer.eos_token_id
    assert out.text.strip() and "<|im_end|>" not in out.text and "<|im_start|>" not in out.text
    assert (
        llm.chat(messages, SamplingParams(max_tokens=128), mode="ar")[0].outputs[0].token_ids == out.token_ids
    )
