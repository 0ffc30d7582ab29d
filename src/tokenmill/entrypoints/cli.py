"""`tokenmill serve | generate | chat | bench` — the command line over the engine."""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import sys

from tokenmill.config import LOAD_BALANCE_METHODS, DataParallelConfig, EngineConfig
from tokenmill.entrypoints.engine_args import add_engine_args, byte_size, engine_kwargs
from tokenmill.errors import ModelLoadError, TokenmillError


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens)
    g.add_argument("--temperature", type=float, default=0.7)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--sampling-seed", type=int, default=None, help="per-request seed")
    g.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    g.add_argument("--ignore-eos", action="store_true")


def sampling_params(args: argparse.Namespace):
    from tokenmill.sample.sampling_params import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens, temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
        min_p=args.min_p, seed=args.sampling_seed, stop=args.stop, ignore_eos=args.ignore_eos,
    )


def cmd_generate(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    if args.stream:
        for piece in llm.stream(args.prompt, params):
            print(piece, end="", flush=True)
        print()
        return 0
    out = llm.generate(args.prompt, params)[0]
    print(out.outputs[0].text)
    return 0


def cmd_chat(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.llm import LLM

    llm = LLM(args.model, **engine_kwargs(args))
    params = sampling_params(args)
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    print("tokenmill chat — type a message; /bye or Ctrl-D to quit, /clear to forget the conversation.")
    while True:
        try:
            line = input(">>> ")
        except (EOFError, KeyboardInterrupt):
            print()
            return 0
        if line.strip() in ("/bye", "/exit", "/quit"):
            return 0
        if line.strip() == "/clear":
            messages = messages[:1] if args.system else []
            continue
        if line.strip().startswith("/") and " " not in line.strip():
            print(f"unknown command {line.strip()}: /bye, /exit, /quit and /clear are the commands")
            continue
        if not line.strip():
            continue
        turn = [*messages, {"role": "user", "content": line}]
        reply = []
        try:
            prompt = {"prompt_token_ids": llm.chat_prompt_ids(turn)}
            for piece in llm.stream(prompt, params):
                reply.append(piece)
                print(piece, end="", flush=True)
        except KeyboardInterrupt:
            pass  # stop this reply; the stream's cleanup aborts the request
        except TokenmillError as exc:  # this message cannot run (too long, ...): the conversation goes on
            print(f"\nerror: {exc} (the message was not added; /clear starts over)")
            continue
        print()
        messages = [*turn, {"role": "assistant", "content": "".join(reply)}]


def cmd_serve(args: argparse.Namespace) -> int:
    from tokenmill.entrypoints.openai.api_server import ServerConfig, run_server
    from tokenmill.model.default_model import default_model_path
    from tokenmill.model.preflight import check_model_path

    models = args.model or []
    if len(models) > 1 or args.models_dir or args.idle_unload_seconds is not None:
        return _serve_models(args)
    if models and not os.path.exists(models[0]):  # `--model NAME=PATH` alone: PATH served as NAME
        from tokenmill.frontend.model_router import parse_model_arg

        name, path = parse_model_arg(models[0])
        if path != models[0]:
            models, args.served_model_name = [path], args.served_model_name or name
    model = os.path.abspath(os.path.expanduser(models[0])) if models else None
    # Validate the engine settings and find the model here, so mistakes fail before anything starts.
    engine = EngineConfig.from_kwargs(model=model, **engine_kwargs(args))
    model_path = model or default_model_path()
    try:  # a path that is plainly not a model fails here, in one line, before any process starts
        check_model_path(model_path)
    except ModelLoadError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.data_parallel_size > 1 and (engine.master_port or engine.nnodes > 1):
        # Every replica's scheduler is rank 0 of its own TP group on its own port, on this machine.
        print("error: with --data-parallel-size, tensor parallelism runs on one node with --master-port 0 "
              "(each replica's group picks its own port)", file=sys.stderr)
        return 2
    if engine.node_rank > 0:  # a machine that only lends its ranks to node 0's engine
        from tokenmill.parallel.launch import run_node_workers

        return run_node_workers(engine, args.log_level)
    config = ServerConfig(
        engine=engine, model_path=model_path, host=args.host, port=args.port, api_key=args.api_key,
        served_model_name=args.served_model_name, log_level=args.log_level, reasoning_parser=args.reasoning_parser,
        tool_call_parser=args.tool_call_parser, chat_template=args.chat_template,
    )
    if args.max_request_bytes is not None:
        config = dataclasses.replace(config, max_request_bytes=args.max_request_bytes)
    if args.shutdown_timeout is not None:
        config = dataclasses.replace(config, shutdown_timeout=args.shutdown_timeout)
    if args.max_queued_requests is not None:
        config = dataclasses.replace(config, max_queued_requests=args.max_queued_requests)
    if args.data_parallel_size > 1:
        config = dataclasses.replace(config, data_parallel=DataParallelConfig(
            args.data_parallel_size, args.load_balance_method))
    if args.tokenizer_workers:
        config = dataclasses.replace(config, tokenizer_workers=args.tokenizer_workers)
    try:
        return run_server(config)
    except KeyboardInterrupt:  # uvicorn re-raises the Ctrl-C it handled, after a clean shutdown
        return 0


def _serve_models(args: argparse.Namespace) -> int:
    """`tokenmill serve --model A --model B` / `--models-dir DIR`: the model router (model_pool.py)."""
    from tokenmill.entrypoints.openai.api_server import ServerConfig, run_server
    from tokenmill.frontend.model_router import RouterConfig, models_in, parse_model_arg

    try:
        found = [parse_model_arg(m) for m in args.model or []] + (models_in(args.models_dir) if args.models_dir else [])
        found = [(name, os.path.abspath(os.path.expanduser(path))) for name, path in found]
        missing = next((path for _, path in found if not os.path.exists(path)), None)
        if missing is not None:
            raise ValueError(f"no model at {missing}")
        routed = RouterConfig(tuple(found), args.max_loaded_models, args.max_memory, args.idle_unload_seconds)
        routed.router()  # duplicate names and bad bounds fail here, before the server starts
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.data_parallel_size > 1 or args.tokenizer_workers or args.served_model_name:
        print("error: with several models, --data-parallel-size, --tokenizer-workers and --served-model-name are "
              "not available (name a model with --model NAME=PATH)", file=sys.stderr)
        return 2
    engine = EngineConfig.from_kwargs(model=found[0][1], **engine_kwargs(args))
    config = ServerConfig(
        engine=engine, model_path=found[0][1], host=args.host, port=args.port, api_key=args.api_key,
        log_level=args.log_level, reasoning_parser=args.reasoning_parser, tool_call_parser=args.tool_call_parser,
        chat_template=args.chat_template, models=routed,
    )
    for flag in ("max_request_bytes", "shutdown_timeout", "max_queued_requests"):
        if getattr(args, flag) is not None:
            config = dataclasses.replace(config, **{flag: getattr(args, flag)})
    try:
        return run_server(config)
    except KeyboardInterrupt:
        return 0


def _port(text: str) -> int:
    try:
        port = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an integer port, got {text!r}") from None
    if not 0 <= port <= 65535:
        raise argparse.ArgumentTypeError(f"must be 0-65535, got {port}")
    return port


def _chat_template_text(value: str) -> str:
    from tokenmill.frontend.chat_template import load_chat_template

    try:
        return load_chat_template(value)
    except (OSError, ValueError) as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _reasoning_parser_name(text: str) -> str:
    from tokenmill.frontend.reasoning_parser import get_reasoning_parser

    try:
        return get_reasoning_parser(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _tool_call_parser_name(text: str) -> str:
    from tokenmill.frontend.tool_parsers import get_tool_parser

    try:
        return get_tool_parser(text).name
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _non_negative_float(text: str) -> float:
    value = float(text)
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"must be a number >= 0, got {text}")
    return value


def _non_negative_int(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return int(text)


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {text}")
    return value


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="tokenmill", description="LLM inference engine")
    parser.add_argument("--log-level", default="WARNING")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("serve", help="OpenAI-compatible HTTP server (chat, completions, metrics, health)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=_port, default=8000)
    p.add_argument("--api-key", default=os.environ.get("TOKENMILL_API_KEY"),
                   help="require 'Authorization: Bearer KEY' on every endpoint but /health "
                        "(default: $TOKENMILL_API_KEY, else none)")
    p.add_argument("--served-model-name", default=None, help="model name in the API (default: the file's name)")
    p.add_argument("--max-request-bytes", type=_positive_int, default=None,
                   help="larger request bodies get 413 before they are read (default: 4 MiB)")
    p.add_argument("--reasoning-parser", type=_reasoning_parser_name, default=None, metavar="NAME",
                   help="split <think>...</think> into reasoning_content: deepseek_r1 or qwen3 (default: none)")
    p.add_argument("--chat-template", type=_chat_template_text, default=None, metavar="FILE_OR_JINJA",
                   help="chat template for /v1/chat/completions instead of the model's (a file, or the Jinja "
                        "text itself): base models have none")
    p.add_argument("--tool-call-parser", type=_tool_call_parser_name, default=None, metavar="NAME",
                   help="read the model's tool calls into message.tool_calls: hermes, llama3_json, mistral "
                        "or glm45 (default: the one the chat template writes, if recognised, else none; "
                        "a parser that does not match the template is logged as a warning)")
    p.add_argument("--max-queued-requests", type=_positive_int, default=None,
                   help="requests admitted but not yet producing output beyond this get 503 + Retry-After "
                        "(default: the KV pool's tokens / 64, at least 256)")
    p.add_argument("--tokenizer-workers", type=_non_negative_int, default=0, metavar="N",
                   help="render chat templates and tokenize in N worker processes, so a huge prompt cannot "
                        "stall other streams (SGLang's --tokenizer-worker-num; default 0: a thread)")
    p.add_argument("--shutdown-timeout", type=_non_negative_float, default=None,
                   help="on SIGTERM, seconds the running requests get to finish while new ones get 503; "
                        "the rest then end with finish_reason 'abort' (default: 20)")
    p.add_argument("--data-parallel-size", "--dp", type=_positive_int, default=1, metavar="N",
                   help="N engine processes (each its own KV pool and --num-threads / N threads) behind "
                        "this one HTTP server (default: 1)")
    p.add_argument("--load-balance-method", choices=list(LOAD_BALANCE_METHODS), default="round_robin",
                   help="how requests are spread over the --data-parallel-size replicas; prefix_aware "
                        "sends shared prompt prefixes to the replica that cached them (default: round_robin)")
    g = p.add_argument_group("several models (each loaded on its first request, in its own processes)")
    g.add_argument("--models-dir", default=None, metavar="DIR",
                   help="serve every GGUF file and model folder in DIR (with any --model given too)")
    g.add_argument("--max-loaded-models", type=_positive_int, default=None, metavar="N",
                   help="at most N models loaded at once: the least recently used idle one unloads first")
    g.add_argument("--max-memory", type=byte_size, default=None, metavar="SIZE",
                   help="loaded models' resident memory bound (e.g. 8G): least recently used idle ones unload")
    g.add_argument("--idle-unload-seconds", type=_non_negative_float, default=None, metavar="S",
                   help="unload a model S seconds after its last request finished (default: never)")
    add_engine_args(p, several_models=True)
    p.set_defaults(func=cmd_serve)

    p = sub.add_parser("generate", help="complete one prompt and print the text")
    p.add_argument("prompt")
    p.add_argument("--stream", action="store_true", help="print the text as it is generated")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=128)
    p.set_defaults(func=cmd_generate)

    p = sub.add_parser("chat", help="interactive chat with the model, streamed")
    p.add_argument("--system", default=None, help="system prompt")
    add_engine_args(p)
    add_sampling_args(p, max_tokens=512)
    p.set_defaults(func=cmd_chat)

    p = sub.add_parser("bench", help="benchmarks (tokenmill bench -h lists them)")
    bench = p.add_subparsers(dest="bench", required=True)
    if "bench" in (sys.argv[1:] if argv is None else argv):
        # Only a bench run builds (imports) the bench commands: they pull in torch, which the
        # server's API process must not hold.
        from tokenmill.bench import add_bench_parsers

        add_bench_parsers(bench)

    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        return args.func(args)
    except TokenmillError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
