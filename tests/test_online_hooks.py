"""What the engine tells drafters that learn online: the target's likeliest next tokens after every
verify forward's rows (``Drafter.observe_candidates``), every finished request
(``Drafter.finish``), and the tenant each request drafts for, which a server derives from the
caller's token and the request (``specdraft.security.tenant_namespace``)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import grpc
import numpy as np
import pytest
import torch

from client.grpc_client import GenerationClient, RequestOptions, build_request
from helpers.models import engine_for, tiny_target
from helpers.servers import ServerThread, tiny_worker
from llm_worker.config import SamplingParams
from llm_worker.drafters import DRAFTERS, DraftContext
from llm_worker.drafters.base import RequestState
from llm_worker.drafters.pld import PromptLookupDrafter
from llm_worker.engine import GenerationRequest
from llm_worker.server import ServerConfig
from llm_worker.types import CANDIDATE_HISTORY, ArtifactNeeds, DraftTree, ForwardCandidates
from specdraft.security import ClientSecurity, ServerSecurity, tenant_namespace

TOKEN = "t" * 32


class Recorder(PromptLookupDrafter):
    """``pld`` that keeps what the engine shows it."""

    candidates = 3

    def __init__(self) -> None:
        super().__init__()
        self.seen: list[ForwardCandidates] = []
        self.finished: list[tuple[str, np.ndarray, int]] = []
        self.proposed: list[int] = []

    def propose(self, ctx: DraftContext) -> DraftTree:
        self.proposed.append(len(ctx.tokens))
        return super().propose(ctx)

    def observe_candidates(self, state: RequestState, rows: ForwardCandidates) -> None:
        copied = (rows.inputs, rows.parents, rows.history, rows.candidates)
        self.seen.append(ForwardCandidates(*(a.copy() for a in copied)))

    def finish(self, state: RequestState, tokens: np.ndarray, prompt_length: int) -> None:
        self.finished.append((state.tenant, tokens.copy(), prompt_length))


@pytest.fixture
def recorder() -> Iterator[Recorder]:
    drafter = Recorder()
    with DRAFTERS.registered("test-online", "test only", lambda target, opts, res: drafter):
        yield drafter


def test_a_drafter_sees_each_forwards_candidates_and_each_finished_request(recorder: Recorder) -> None:
    target = tiny_target()
    engine = engine_for(target)
    prompt = (5, 6, 7, 8, 5, 6, 7, 8, 5, 6, 7)
    req = GenerationRequest(prompt, 24, "test-online", SamplingParams(), tenant="team-a")
    result = engine.generate(req)
    ar = engine.generate(GenerationRequest(prompt, 24, "ar", SamplingParams()))
    assert result.token_ids == ar.token_ids
    committed = [*prompt, *result.token_ids]
    # one observation a decode step; the root row's likeliest token is what greedy emitted next
    assert len(recorder.seen) == result.stats.target_forwards - 1  # the prefill yields the first
    position = len(prompt)
    for rows in recorder.seen:
        inputs, candidates = rows.inputs, rows.candidates
        assert inputs[0] == committed[position] and candidates.shape == (len(inputs), 3)
        assert rows.history.tolist() == committed[max(0, position - CANDIDATE_HISTORY) : position]
        assert rows.parents.tolist() == list(range(-1, len(inputs) - 1))  # pld: a chain
        assert all(len(set(row.tolist())) == 3 for row in candidates)
        emitted = committed[position + 1 :]
        accepted = 0
        while accepted + 1 < min(len(inputs), len(emitted)) and inputs[1 + accepted] == emitted[accepted]:
            accepted += 1  # a chain draft (pld): accepted nodes are a prefix
        if accepted < len(emitted):  # (the last step's tokens may be cut at the length limit)
            assert candidates[accepted, 0] == emitted[accepted]
        position += accepted + 1
    ((tenant, tokens, prompt_length),) = recorder.finished
    assert tenant == "team-a" and prompt_length == len(prompt) and tokens.tolist() == committed


def test_candidates_are_the_targets_top_k(recorder: Recorder) -> None:
    target = tiny_target()
    engine = engine_for(target)
    prompt = (3, 9, 4, 3, 9)
    engine.generate(GenerationRequest(prompt, 1 + 1, "test-online", SamplingParams()))
    inputs, candidates = recorder.seen[0].inputs, recorder.seen[0].candidates
    state = target.start()
    logits = target.forward(state, torch.tensor([*prompt, int(inputs[0])]), None, ArtifactNeeds()).logits[-1]
    assert candidates[0].tolist() == torch.topk(logits, 3).indices.tolist()


def test_tenant_namespaces() -> None:
    assert tenant_namespace("team-a", None) == "team-a"
    assert tenant_namespace("", "") == ""
    inside = tenant_namespace("team-a", TOKEN)
    assert inside.endswith("/team-a") and TOKEN not in inside
    assert inside != tenant_namespace("team-a", "u" * 32)
    with pytest.raises(ValueError, match="at most 128"):
        tenant_namespace("x" * 129, None)
    with pytest.raises(ValueError, match="printable"):
        tenant_namespace("a\nb", None)


def test_a_server_puts_a_request_in_its_tokens_namespace(tiny_dir: Path, recorder: Recorder) -> None:
    worker = tiny_worker(tiny_dir, "w-tenant")
    server = ServerThread(worker, ServerConfig(port=0, security=ServerSecurity(tokens=(TOKEN,))))
    try:
        with GenerationClient([server.address], timeout=60, security=ClientSecurity(token=TOKEN)) as client:
            options = RequestOptions(mode="test-online", max_new_tokens=4, tenant="team-a")
            client.generate(build_request(text="hello world hello", options=options))
            bad = RequestOptions(mode="test-online", max_new_tokens=4, tenant="x" * 200)
            with pytest.raises(grpc.RpcError) as err:
                client.generate(build_request(text="hello world hello", options=bad))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "tenant has at most 128 characters" in str(err.value.details())
        ((tenant, _, _),) = recorder.finished
        assert tenant == tenant_namespace("team-a", TOKEN)
    finally:
        server.stop()
