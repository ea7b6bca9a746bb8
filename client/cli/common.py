"""What every command group shares: the parser class, exit codes, the model and datastore
options and the typed configuration built from them."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

from specdraft.common import atomic_write_text

PREFIX_CACHE_MB = 256
"""--prefix-cache-mb's default: ``EngineConfig.prefix_cache_bytes`` in MiB, written here so that
building the parser loads no torch (a test checks that the two agree)."""

if TYPE_CHECKING:
    from llm_worker.assembly import ResourceConfig
    from llm_worker.config import EngineConfig, ModelConfig
    from llm_worker.engine import Engine
    from llm_worker.model.target import TargetModel

EXIT_BAD_INPUT = 2


class CliError(Exception):
    """A user error with a message worth printing as is."""


class Parser(argparse.ArgumentParser):
    """argparse, but usage errors follow the contract: one line, exit code 2."""

    def error(self, message: str) -> None:  # type: ignore[override]
        sys.stderr.write(f"specdraft: error: {message} (see {self.prog} --help)\n")
        raise SystemExit(EXIT_BAD_INPUT)


class VersionAction(argparse.Action):
    """``specdraft --version``: the package's version, torch's and transformers', and whether the
    fused CPU kernels can run here; computed only when asked (it imports torch), then exit 0::

        specdraft 0.1.0
        torch 2.13.0+cpu
        transformers 5.23.0
        native kernels: yes (built in /root/.cache/specdraft/native/specdraft_fused_718a6c36f6fc)
        compiled retrieval: yes (built in /root/.cache/specdraft/native/specdraft_retrieval_29c905cf1ea3)
    """

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_: Any) -> None:
        from importlib.metadata import version

        from datastore_svc import native as retrieval_native
        from llm_worker.model import native

        lines = [f"specdraft {version('specdraft')}", f"torch {version('torch')}"]
        lines += [f"transformers {version('transformers')}", f"native kernels: {native.describe()}"]
        lines += [f"compiled retrieval: {retrieval_native.describe()}"]
        sys.stdout.write("\n".join(lines) + "\n")
        parser.exit(0)


def positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def non_negative_int(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def addresses(text: str) -> tuple[str, ...]:
    """``"a:1, b:2,"`` → ``("a:1", "b:2")``."""
    return tuple(a.strip() for a in text.split(",") if a.strip())


def print_json(payload: Any, json_out: str | None = None, indent: int | None = None) -> None:
    """One JSON object on stdout; also written (atomically, indented) to ``json_out`` if given."""
    text = json.dumps(payload, indent=indent)
    sys.stdout.write(text + "\n")
    if json_out:
        atomic_write_text(Path(json_out), (text if indent else json.dumps(payload, indent=1)) + "\n")


def add_model_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("model")
    g.add_argument(
        "--model",
        default=None,
        help="a Hugging Face model directory, or a Hub id (ORG/NAME) in the local Hugging Face cache "
        "(default: SmolLM2-135M-Instruct)",
    )
    g.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    g.add_argument("--device", default="cpu", help="torch device, e.g. cpu, cuda, cuda:1")
    g.add_argument(
        "--threads", type=positive_int, default=None, help="torch CPU threads (default: torch's choice)"
    )
    g.add_argument(
        "--backend",
        default="auto",
        choices=["auto", "fast", "hf"],
        help="fast Llama-family forward or transformers'",
    )
    g.add_argument(
        "--kernel",
        default="auto",
        help="fast backend GEMM kernel, LIBRARY:MIN_ROWS (aten, onednn, quant or bf16 on CPU; triton "
        "with --ops triton); auto: the fastest of those checked batch-invariant on this machine",
    )
    g.add_argument(
        "--no-fused",
        dest="fused",
        action="store_false",
        help="fast backend: torch operations between the GEMMs instead of the fused CPU kernels",
    )
    g.add_argument(
        "--ops",
        default="auto",
        choices=["auto", "triton", "torch", "fused"],
        help="fast backend operations: triton (row-invariant kernels, CUDA), torch (on CUDA cuBLAS: "
        "faster, not batch-invariant), fused (CPU kernels); auto: triton on CUDA, fused on CPU",
    )
    g.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="fast backend, triton operations: decode and verify steps of up to 64 rows replayed "
        "from CUDA graphs (not yet run on a GPU)",
    )
    g.add_argument(
        "--prefix-cache-mb",
        type=float,
        default=PREFIX_CACHE_MB,
        help="memory for the KV of prompt prefixes reused across requests (shared system prompts, "
        "chat histories; fast backend only); 0 turns the prefix cache off",
    )
    g.add_argument(
        "--max-model-len",
        type=positive_int,
        default=None,
        help="cap on prompt + generated tokens, below the model's own context (default: the model's)",
    )


def model_config(args: argparse.Namespace, backend: Literal["hf"] | None = None) -> ModelConfig:
    """The model options as a ``ModelConfig``; ``backend`` overrides --backend (the dense build
    reads hidden states through transformers' batched forward)."""
    from llm_worker.config import ModelConfig

    return ModelConfig(
        path=args.model,
        dtype=args.dtype,
        device=args.device,
        threads=args.threads,
        backend=backend or args.backend,
        kernel=args.kernel,
        fused_kernels=args.fused,
        ops=args.ops,
        cuda_graphs=args.cuda_graphs,
        max_context=args.max_model_len,
    )


def engine_config(args: argparse.Namespace) -> EngineConfig:
    """The decode loop's options of this command (``EngineConfig``)."""
    from llm_worker.config import EngineConfig

    mb = getattr(args, "prefix_cache_mb", PREFIX_CACHE_MB)
    if mb < 0:
        raise CliError(f"--prefix-cache-mb must be >= 0, got {mb}")
    return EngineConfig(prefix_cache_bytes=int(mb * (1 << 20)))


def worker_model_args(args: argparse.Namespace, threads: int | None) -> list[str]:
    """The model options of this command, as ``specdraft serve worker`` arguments."""
    out = ["--dtype", args.dtype, "--device", args.device, "--backend", args.backend, "--kernel", args.kernel]
    out += ["--model", args.model] if args.model else []
    out += [] if args.fused else ["--no-fused"]
    out += ["--ops", args.ops] if args.ops != "auto" else []
    out += ["--cuda-graphs"] if args.cuda_graphs else []
    out += ["--prefix-cache-mb", str(getattr(args, "prefix_cache_mb", PREFIX_CACHE_MB))]
    out += ["--max-model-len", str(args.max_model_len)] if args.max_model_len else []
    return out + (["--threads", str(threads)] if threads else [])


def add_online_store_args(p: argparse.ArgumentParser) -> None:
    """The bounds of a worker's online drafting stores (``serve worker``, ``serve http``, and
    ``up``, which passes them to its workers: ``online_store_args``). The defaults are
    ``llm_worker.assembly.ResourceConfig``'s (not imported here: parsing stays fast)."""
    g = p.add_argument_group("online drafting (suffix, recycle)")
    g.add_argument(
        "--suffix-max-tokens",
        type=positive_int,
        default=262_144,
        help="tokens suffix mode keeps of finished requests, over all tenants (oldest evicted)",
    )
    g.add_argument(
        "--recycle-max-tenants",
        type=positive_int,
        default=16,
        help="Token Recycling matrices kept, one per tenant (least recently used evicted)",
    )


def online_store_args(args: argparse.Namespace) -> list[str]:
    """``add_online_store_args``'s options of this command as ``serve worker`` arguments:
    ``["--suffix-max-tokens", "262144", "--recycle-max-tenants", "16"]`` by default."""
    return [
        "--suffix-max-tokens",
        str(args.suffix_max_tokens),
        "--recycle-max-tenants",
        str(args.recycle_max_tenants),
    ]


def add_chat_template_arg(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--chat-template",
        metavar="FILE",
        help="a Jinja chat template rendering chat prompts instead of the tokenizer's own",
    )


def chat_template(args: argparse.Namespace) -> str | None:
    """The text of ``--chat-template FILE`` (None without it); CliError if it cannot be read."""
    if not args.chat_template:
        return None
    try:
        return Path(args.chat_template).read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        raise CliError(f"--chat-template {args.chat_template}: {exc}") from None


def check_mode(mode: str) -> None:
    """Refuse an unknown mode or option name before any model loads (a CliError, exit 2):
    ``pld:windw=3`` fails in about a second instead of after the model's start-up."""
    from llm_worker.drafters import DRAFTERS, UnknownModeError

    try:
        DRAFTERS.check(mode)
    except UnknownModeError as exc:
        raise CliError(str(exc)) from None


def add_datastore_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("datastore (for rest)")
    g.add_argument("--datastore", help="a datastore version directory, loaded in this process")
    g.add_argument("--datastore-addr", help="HOST:PORT[,HOST:PORT...] of datastore shards, one per shard")
    g.add_argument(
        "--datastore-deadline-ms", type=float, default=20.0, help="per-shard deadline of a remote retrieval"
    )
    g.add_argument(
        "--dense-cache",
        help="redis://HOST:PORT[/DB] caching dense statistics and query results (dresd), shared by workers",
    )
    g.add_argument("--dense-cache-ttl", type=int, default=600, help="seconds a cached dense query lives")
    g.add_argument(
        "--dense-cache-context",
        type=int,
        default=0,
        help="key cached dense queries by the last N context tokens (0 = the whole context)",
    )
    p.add_argument(
        "--heads-file",
        help="induction-head calibration for pld+a (default: the one shipped or calibrated for the model)",
    )
    p.add_argument(
        "--drafters-dir",
        help="learned drafters' checkpoints (glide.json, glide-vanilla.json, edd.json),"
        " before the shipped ones",
    )
    p.add_argument(
        "--recycle-seed",
        metavar="FILE",
        help="rows every tenant's recycle starts from (specdraft datastore recycle-seed); default: empty",
    )
    add_client_security_args(p, prefix="datastore-")


def model_from_args(
    args: argparse.Namespace, backend: Literal["hf"] | None = None
) -> tuple[TargetModel, Any]:
    """(target, tokenizer) of the model options."""
    from llm_worker.assembly import AssemblyError, load_model

    try:
        return load_model(model_config(args, backend))
    except AssemblyError as exc:
        raise CliError(str(exc)) from exc


def resource_config(args: argparse.Namespace) -> ResourceConfig:
    """What the engine drafts from: the datastore options and, where the command has them
    (``serve worker``), the bounds of the online stores; defaults for what it lacks."""
    from llm_worker.assembly import ResourceConfig

    defaults = ResourceConfig()
    return ResourceConfig(
        datastore_path=getattr(args, "datastore", None),
        datastore_addresses=addresses(getattr(args, "datastore_addr", None) or ""),
        datastore_deadline_seconds=getattr(args, "datastore_deadline_ms", 20.0) / 1000.0,
        dense_cache_url=getattr(args, "dense_cache", None),
        dense_cache_ttl_seconds=getattr(args, "dense_cache_ttl", 600),
        dense_cache_context_tokens=getattr(args, "dense_cache_context", 0),
        device=getattr(args, "device", "cpu") or "cpu",
        datastore_security=client_security(args, prefix="datastore-"),
        heads_file=getattr(args, "heads_file", None),
        drafters_dir=getattr(args, "drafters_dir", None),
        recycle_seed=getattr(args, "recycle_seed", None),
        suffix_max_tokens=getattr(args, "suffix_max_tokens", defaults.suffix_max_tokens),
        recycle_max_tenants=getattr(args, "recycle_max_tenants", defaults.recycle_max_tenants),
    )


def engine_from_args(args: argparse.Namespace) -> tuple[Engine, TargetModel, Any]:
    """(engine, target, tokenizer) of the model options and, where the command has them, the
    datastore options (``resource_config``)."""
    from llm_worker.assembly import AssemblyError, load_engine

    try:
        return load_engine(model_config(args), resource_config(args), engine_config(args))
    except AssemblyError as exc:
        raise CliError(str(exc)) from exc


def tokenizer_from_args(args: argparse.Namespace) -> tuple[Any, Any]:
    """(tokenizer, model directory) of --model, without the weights."""
    from llm_worker.assembly import AssemblyError, load_tokenizer

    try:
        return load_tokenizer(args.model)
    except AssemblyError as exc:
        raise CliError(str(exc)) from exc


# -- transport security -----------------------------------------------------------------------------


def add_server_security_args(p: argparse.ArgumentParser, admin: bool = False) -> None:
    """TLS, mutual TLS and tokens of a server (``specdraft.security.ServerSecurity``)."""
    from specdraft.security import ADMIN_TOKEN_ENV, TOKEN_ENV

    g = p.add_argument_group("transport security (README, Security)")
    g.add_argument("--tls-cert", help="PEM certificate chain of this server: serve TLS")
    g.add_argument("--tls-key", help="PEM private key of --tls-cert")
    g.add_argument(
        "--tls-ca", help="PEM CA bundle: clients must present a certificate it signed (mutual TLS)"
    )
    g.add_argument(
        "--token-file", help=f"bearer tokens accepted, one per line (default: ${TOKEN_ENV}); none = no check"
    )
    g.add_argument(
        "--insecure",
        action="store_true",
        help="allow plaintext on a non-loopback address, tokens or not (logged as a warning)",
    )
    g.add_argument(
        "--health-port",
        type=int,
        default=None,
        help="plaintext port serving only health (for TLS-less probes)",
    )
    if admin:
        g.add_argument(
            "--admin-token-file",
            help=f"tokens of the admin identity, one per line (default: ${ADMIN_TOKEN_ENV})",
        )
        g.add_argument(
            "--admin-cert-name",
            action="append",
            default=[],
            help="a client-certificate name (CN or SAN) that is an admin (mutual TLS; repeatable)",
        )


def server_security(args: argparse.Namespace) -> Any:
    from specdraft.security import ADMIN_TOKEN_ENV, TOKEN_ENV, SecurityError, ServerSecurity, read_tokens

    try:
        security = ServerSecurity(
            cert=args.tls_cert,
            key=args.tls_key,
            ca=args.tls_ca,
            tokens=read_tokens(args.token_file, TOKEN_ENV),
            admin_tokens=read_tokens(getattr(args, "admin_token_file", None), ADMIN_TOKEN_ENV)
            if hasattr(args, "admin_token_file")
            else (),
            admin_names=tuple(getattr(args, "admin_cert_name", ())),
            insecure=args.insecure,
        )
        if security.tls:
            security.credentials()  # the PEM files are readable now, not at the first bind
        return security
    except SecurityError as exc:
        raise CliError(str(exc)) from exc


def add_client_security_args(p: argparse.ArgumentParser, admin: bool = False, prefix: str = "") -> None:
    """TLS, client certificate and token of a client (``specdraft.security.ClientSecurity``);
    ``prefix`` (e.g. ``datastore-``) names the options of a second kind of server."""
    from specdraft.security import ADMIN_TOKEN_ENV

    g = p.add_argument_group(f"{prefix}client transport security (README, Security)")
    g.add_argument(f"--{prefix}tls", action="store_true", help="use TLS (implied by the next three)")
    g.add_argument(f"--{prefix}tls-ca", help="PEM CA bundle that signed the servers' certificates")
    g.add_argument(f"--{prefix}tls-cert", help="PEM client certificate (mutual TLS)")
    g.add_argument(f"--{prefix}tls-key", help="PEM private key of the client certificate")
    g.add_argument(f"--{prefix}tls-server-name", help="check the servers' certificates against this name")
    g.add_argument(
        f"--{prefix}insecure",
        action="store_true",
        help="send the token in plaintext to a non-loopback address (logged as a warning)",
    )
    if admin:
        g.add_argument(
            f"--{prefix}admin-token-file", help=f"the admin token to send (default: ${ADMIN_TOKEN_ENV})"
        )
    else:
        g.add_argument(
            f"--{prefix}token-file", help=f"the bearer token to send (default: ${_token_env(prefix)})"
        )


def _token_env(prefix: str) -> str:
    """The environment variable of a client's token: ``SPECDRAFT_TOKEN``, or with a prefix
    ``datastore-`` ``SPECDRAFT_DATASTORE_TOKEN``."""
    from specdraft.security import TOKEN_ENV

    return TOKEN_ENV if not prefix else f"SPECDRAFT_{prefix.strip('-').upper()}_TOKEN"


def client_security(args: argparse.Namespace, admin: bool = False, prefix: str = "") -> Any:
    from specdraft.security import ADMIN_TOKEN_ENV, ClientSecurity, SecurityError, read_tokens

    key = prefix.replace("-", "_")

    def arg(name: str) -> Any:
        return getattr(args, f"{key}{name}", None)

    try:
        if admin:
            tokens = read_tokens(arg("admin_token_file"), ADMIN_TOKEN_ENV)
        else:
            tokens = read_tokens(arg("token_file"), _token_env(prefix))
        return ClientSecurity(
            ca=arg("tls_ca"),
            cert=arg("tls_cert"),
            key=arg("tls_key"),
            token=tokens[0] if tokens else None,
            tls=bool(arg("tls")),
            server_name=arg("tls_server_name"),
            insecure=bool(arg("insecure")),
        )
    except SecurityError as exc:
        raise CliError(str(exc)) from exc
