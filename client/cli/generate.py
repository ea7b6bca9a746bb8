"""``specdraft generate`` (in process, or through workers found by address or in a registry) and
``specdraft modes``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from client.cli.common import (
    CliError,
    add_chat_template_arg,
    add_client_security_args,
    add_datastore_args,
    add_model_args,
    addresses,
    chat_template,
    check_mode,
    client_security,
    engine_from_args,
)
from llm_worker.config import DEFAULT_MODE

if TYPE_CHECKING:
    from llm_worker.worker import ModeDescription


def add_generate(sub: Any) -> None:
    g = sub.add_parser("generate", help="generate text for one prompt")
    add_model_args(g)
    add_datastore_args(g)
    g.add_argument("prompt", help="the prompt text, or - to read it from stdin")
    g.add_argument(
        "--mode", default=DEFAULT_MODE, help="drafting mode, e.g. ar, pld, pld+h, pld+a, pld+h:layer=12"
    )
    g.add_argument("--max-new-tokens", type=int, default=128)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0)
    g.add_argument("--seed", type=int, default=None)
    g.add_argument(
        "--stop",
        action="append",
        default=[],
        metavar="TEXT",
        help="stop where the text reaches TEXT (not printed); repeatable, at most 4",
    )
    g.add_argument(
        "--stop-token-id", action="append", type=int, default=[], metavar="ID", help="stop after token ID"
    )
    g.add_argument(
        "--logprobs",
        type=int,
        default=None,
        metavar="K",
        help="log-probability of each token and its K likeliest alternatives (0..20) in --json",
    )
    g.add_argument("--presence-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument("--frequency-penalty", type=float, default=0.0, help="OpenAI's, in [-2, 2]")
    g.add_argument(
        "--repetition-penalty", type=float, default=1.0, help="vLLM's, > 0 (1: none), over prompt + output"
    )
    g.add_argument(
        "--chat", action="store_true", help="apply the model's chat template (PROMPT is one user turn)"
    )
    g.add_argument("--system", help="with --chat: a system prompt before the user turn")
    add_chat_template_arg(g)
    g.add_argument(
        "--stream", action="store_true", help="print text as it is generated (to stderr with --json)"
    )
    g.add_argument("--json", action="store_true", help="print exactly one JSON object on stdout")
    g.add_argument("--server", help="HOST:PORT[,HOST:PORT...] of workers; default: decode in this process")
    g.add_argument("--registry", help="find workers serving --mode in this registry (redis://HOST:PORT)")
    g.add_argument("--timeout", type=float, default=300.0, help="deadline in seconds with --server")
    add_client_security_args(g)
    g.set_defaults(func=cmd_generate)


def add_modes(sub: Any) -> None:
    m = sub.add_parser("modes", help="list drafting modes")
    add_model_args(m)
    add_datastore_args(m)
    m.add_argument(
        "--json", action="store_true", help="print one JSON list: name, summary, options, available, reason"
    )
    m.set_defaults(func=cmd_modes)


def cmd_generate(args: argparse.Namespace) -> int:
    prompt = sys.stdin.read() if args.prompt == "-" else args.prompt
    if not prompt:
        raise CliError("the prompt is empty")
    if (args.system is not None or args.chat_template) and not args.chat:
        raise CliError("--system and --chat-template apply to chat prompts: add --chat")
    if args.chat_template and (args.server or args.registry):
        raise CliError("a worker renders chat with its own template: give --chat-template to serve worker")
    if args.registry and not args.server:
        args.server = _discover(args.registry, args.mode)
    if args.server:
        return _generate_remote(args, prompt)
    return _generate_local(args, prompt)


def _chat(args: argparse.Namespace, prompt: str) -> list[tuple[str, str]]:
    """The chat of ``--chat``: the prompt as one user turn, after ``--system``'s turn if given."""
    return ([("system", args.system)] if args.system is not None else []) + [("user", prompt)]


def _generate_local(args: argparse.Namespace, prompt: str) -> int:
    check_mode(args.mode)
    template = chat_template(args)
    engine, _target, tokenizer = engine_from_args(args)
    from llm_worker.chat import chat_prompt_ids, prompt_ids
    from llm_worker.config import SamplingParams
    from llm_worker.drafters import ModeUnavailableError, UnknownModeError
    from llm_worker.engine import GenerationRequest, InvalidRequestError, StepOutput
    from llm_worker.results import GenerationResult
    from llm_worker.stopping import StopStrings, cut_at_stop
    from llm_worker.textstream import TextStream

    try:
        ids = (
            chat_prompt_ids(tokenizer, [{"role": r, "content": c} for r, c in _chat(args, prompt)], template)
            if args.chat
            else prompt_ids(tokenizer, prompt)
        )
        sampling = SamplingParams(
            args.temperature,
            args.top_p,
            args.top_k,
            args.seed,
            presence_penalty=args.presence_penalty,
            frequency_penalty=args.frequency_penalty,
            repetition_penalty=args.repetition_penalty,
        )

        def decode(ids: Sequence[int]) -> str:
            return str(tokenizer.decode(list(ids), skip_special_tokens=True))

        req = GenerationRequest(
            tuple(ids),
            args.max_new_tokens,
            args.mode,
            sampling,
            stop_token_ids=tuple(args.stop_token_id),
            stop=StopStrings(args.stop, decode) if args.stop else None,
            logprobs=args.logprobs,
        )
        stream_to = sys.stderr if args.json else sys.stdout
        result = None
        text_stream = TextStream(decode, args.stop)
        for item in engine.stream(req):
            if isinstance(item, StepOutput) and args.stream:
                stream_to.write(text_stream.push(item.token_ids))
                stream_to.flush()
            elif isinstance(item, GenerationResult):
                result = item
                if args.stream:
                    stream_to.write(text_stream.finish())
    except (UnknownModeError, ModeUnavailableError, InvalidRequestError, ValueError) as exc:
        raise CliError(str(exc)) from exc
    assert result is not None
    text = cut_at_stop(decode(result.token_ids), args.stop)
    if args.json:
        if args.stream:
            sys.stderr.write("\n")
        sys.stdout.write(json.dumps(result.to_json(text, len(ids))) + "\n")
    elif args.stream:
        sys.stdout.write("\n")
    else:
        sys.stdout.write(text + "\n")
    return 0


def _discover(url: str, mode: str) -> str:
    from llm_worker.registry import discover, open_registry

    try:
        found = discover(open_registry(url), mode)
    except ValueError as exc:
        raise CliError(str(exc)) from exc
    except Exception as exc:  # the registry itself is unreachable
        sys.stderr.write(f"specdraft: error: registry {url} unreachable: {exc}\n")
        raise SystemExit(1) from exc
    if not found:
        raise CliError(f"no live worker in {url} serves mode {mode!r}")
    return ",".join(found)


def _generate_remote(args: argparse.Namespace, prompt: str) -> int:
    """``generate --server``: the same request and the same output, through a worker."""
    import grpc

    from client.grpc_client import GenerationClient, RequestOptions, build_request, response_to_json

    options = RequestOptions(
        mode=args.mode,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.seed,
        stop=tuple(args.stop),
        stop_token_ids=tuple(args.stop_token_id),
        logprobs=args.logprobs,
        presence_penalty=args.presence_penalty,
        frequency_penalty=args.frequency_penalty,
        repetition_penalty=args.repetition_penalty,
    )
    request = (
        build_request(chat=_chat(args, prompt), options=options)
        if args.chat
        else build_request(text=prompt, options=options)
    )
    stream_to = sys.stderr if args.json else sys.stdout
    security = client_security(args)
    with GenerationClient(list(addresses(args.server)), timeout=args.timeout, security=security) as client:
        try:
            if args.stream:
                final = None
                for chunk in client.generate_stream(request):
                    if chunk.HasField("final"):
                        final = chunk.final
                    elif chunk.text:
                        stream_to.write(chunk.text)
                        stream_to.flush()
                stream_to.write("\n")
                assert final is not None, "the stream ended without a final message"
                response = final
            else:
                response = client.generate(request)
        except grpc.RpcError as exc:
            code = exc.code()
            message = f"{code.name}: {exc.details()}"
            if code in (grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.RESOURCE_EXHAUSTED):
                raise CliError(message) from None
            sys.stderr.write(f"specdraft: error: {message}\n")
            return 1
    if args.json:
        sys.stdout.write(json.dumps(response_to_json(response)) + "\n")
    elif not args.stream:
        sys.stdout.write(response.text + "\n")
    return 0


def cmd_modes(args: argparse.Namespace) -> int:
    engine, _target, tokenizer = engine_from_args(args)
    from llm_worker.worker import Worker

    modes = Worker(engine, tokenizer).modes()  # what gRPC ListModes answers, reasons included
    if args.json:
        rows = [
            {
                "name": m.name,
                "summary": m.summary,
                "options": list(m.options),
                "available": m.available,
                "unavailable_reason": m.unavailable_reason,
            }
            for m in modes
        ]
        sys.stdout.write(json.dumps(rows) + "\n")
    else:
        sys.stdout.write(modes_text(modes))
    return 0


def modes_text(modes: Sequence[ModeDescription]) -> str:
    """One line per mode, the summaries aligned after the longest name, and under an unavailable
    mode the reason. Example (abridged):

        ar      plain decoding: no drafts
        rest    drafts from a datastore of text (options: ...)
                unavailable here: rest needs a datastore (--datastore or --datastore-addr)
    """
    width = max((len(m.name) for m in modes), default=0)
    lines = []
    for m in modes:
        opts = f" (options: {', '.join(m.options)})" if m.options else ""
        lines.append(f"{m.name:<{width}}  {m.summary}{opts}")
        if not m.available:
            lines.append(f"{'':<{width}}  unavailable here: {m.unavailable_reason}")
    return "".join(line + "\n" for line in lines)
