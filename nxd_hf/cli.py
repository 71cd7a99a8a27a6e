"""The ``nxd-hf`` command. Each subcommand is a function registered in ``SUBCOMMANDS``
(name -> (help, add_arguments, run)); later features add theirs there."""

import argparse
import os
import sys


def _consolidate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="the path passed to nxd_hf.save_checkpoint, or one checkpoint in it "
                        "(out/checkpoint-18)")
    parser.add_argument("output_dir", help="where to write the Hugging Face model directory")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: the newest complete one)")
    parser.add_argument("--max-shard-size", default="5GB", help="largest output file, e.g. 5GB or 500MiB")
    parser.add_argument("--dtype", default=None, choices=["float32", "bfloat16", "float16"],
                        help="cast the weights (default: as saved)")


def _consolidate(args: argparse.Namespace) -> None:
    import torch

    from nxd_hf.checkpoint.consolidate import consolidate

    consolidate(args.checkpoint_dir, args.output_dir, tag=args.tag, max_shard_size=args.max_shard_size,
                dtype=getattr(torch, args.dtype) if args.dtype else None)
    print(f"wrote {args.output_dir}")


def _check_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a directory holding the model's config.json")
    parser.add_argument("--tp", type=int, required=True, help="tensor_parallel_size")
    parser.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    parser.add_argument("--sp", action="store_true", help="sequence parallelism")
    parser.add_argument("--ep", type=int, default=1, help="expert_parallel_size (mixture-of-experts models)")


def _check(args: argparse.Namespace) -> int:
    from nxd_hf.parity import check_parity

    result = check_parity(args.model_dir, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                          sequence_parallel=args.sp, expert_parallel_size=args.ep)
    layout = f"tp={args.tp} pp={args.pp}" + (" sp" if args.sp else "") + (f" ep={args.ep}" if args.ep > 1 else "")
    print(f"{args.model_dir} ({layout}): {result.status}")
    if result.max_loss_diff is not None:
        print(f"  max |loss diff| {result.max_loss_diff:.2e}, max |grad diff| {result.max_grad_diff:.2e}")
    if result.message:
        print(f"  {result.message}")
    return 0 if result.status == "pass" else 1


def _env_args(parser: argparse.ArgumentParser) -> None:
    pass


def environment() -> str:
    """Versions and backends this process sees: what a bug report needs."""
    import importlib.metadata
    import platform

    import torch
    import torch.distributed as dist

    def version(name: str) -> str:
        try:
            return importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            return "not installed"

    from nxd_hf import backend

    backends = [name for name, ok in (("gloo", dist.is_gloo_available()), ("nccl", dist.is_nccl_available())) if ok]
    if importlib.util.find_spec("torch_xla") is not None:
        backends.append("xla")
    lines = [f"nxd_hf {version('nxd_hf')}", f"python {platform.python_version()} ({platform.platform()})",
             # torch's own version names its build (+cpu, +cu130), which a CUDA wheel's metadata leaves out
             f"torch {torch.__version__}" + (f" (CUDA {torch.version.cuda})" if torch.version.cuda else ""),
             *(f"{name} {version(name)}" for name in ("transformers", "peft", "accelerate", "safetensors")),
             f"collective backends available: {', '.join(backends) or 'none'}",
             f"backend nxd_hf would use: {backend.default_backend()} on "
             f"{backend.launch_device(backend.default_backend(), int(os.environ.get('LOCAL_RANK', 0)))}",
             *_launches(backend),
             f"CUDA devices: {torch.cuda.device_count()}"]
    return "\n".join(lines)


def _launches(backend) -> list[str]:
    """The backend and device of each launch (docs/gpu.md)."""
    import torch

    name = backend.default_backend()
    source = "from $NXD_HF_BACKEND" if os.environ.get("NXD_HF_BACKEND") else "the default"
    one = backend.launch_device(name, 0)
    each = f"cuda:(LOCAL_RANK % {torch.cuda.device_count()})" if one.startswith("cuda:") else one
    return [f"  `python script.py`: a world of one on {name} ({source}), computing on {one}",
            f"  `torchrun --nproc_per_node N script.py`: {name} ({source}), rank computing on {each}"]


def _env(args: argparse.Namespace) -> None:
    print(environment())


def _plan_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("model_dir", help="a directory holding the model's config.json (weights are not read)")
    parser.add_argument("--world-size", type=int, required=True, help="ranks (one accelerator each)")
    parser.add_argument("--memory", required=True, help="memory per rank, e.g. 80GB or 24GiB")
    parser.add_argument("--seq-len", type=int, required=True, help="tokens per sequence")
    parser.add_argument("--micro-batch-size", type=int, default=1, help="sequences per microbatch and replica")
    parser.add_argument("--global-batch-size", type=int, default=None,
                        help="sequences per optimizer step (default: micro batch x world size)")
    parser.add_argument("--lora", action="store_true", help="LoRA (r=16 on q,k,v,o) instead of full training")
    parser.add_argument("--lora-r", type=int, default=16, help="LoRA rank with --lora")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"], help="parameter dtype")
    parser.add_argument("--nodes", type=int, default=1, help="nodes the ranks are spread over")
    parser.add_argument("--device", default="h100", help="speed preset: h100, a100, trn1, cpu")
    parser.add_argument("--top", type=int, default=10, help="ranked layouts to print")
    parser.add_argument("--json", default=None, help="also write the whole plan to this file")


def _plan(args: argparse.Namespace) -> int:
    import json

    from nxd_hf.plan import format_plan, plan
    from nxd_hf.plan.report import as_dict

    lora_config = None
    if args.lora:
        import peft

        lora_config = peft.LoraConfig(r=args.lora_r, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"])
    result = plan(args.model_dir, world_size=args.world_size, device_memory=args.memory, seq_len=args.seq_len,
                  micro_batch_size=args.micro_batch_size, global_batch_size=args.global_batch_size,
                  lora_config=lora_config, dtype=args.dtype, nodes=args.nodes, device=args.device)
    print(format_plan(result, top=args.top))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(as_dict(result), f, indent=1)
    return 0 if result.ranked else 1


SUBCOMMANDS = {
    "consolidate": ("write a checkpoint's model as a plain Hugging Face model directory", _consolidate_args, _consolidate),
    "check": ("parity (loss and every gradient) of MODEL_DIR's architecture, shrunk, on a parallel layout",
              _check_args, _check),
    "env": ("print the versions and backends nxd_hf sees (paste it into bug reports)", _env_args, _env),
    "plan": ("rank the parallel layouts of MODEL_DIR for a cluster: predicted memory per rank and step time",
             _plan_args, _plan),
}


def _epilog() -> str:
    try:
        return "environment:\n  " + environment().replace("\n", "\n  ")
    except Exception as error:  # --help must work even in a broken environment
        return f"environment: unavailable ({error})"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nxd-hf", description="nxd_hf command-line tools",
                                     epilog=_epilog(), formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(commands.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        return SUBCOMMANDS[args.command][2](args) or 0
    except ValueError as error:
        print(f"nxd-hf {args.command}: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
