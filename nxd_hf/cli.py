"""The ``nxd-hf`` command. Each subcommand is a function registered in ``SUBCOMMANDS``
(name -> (help, add_arguments, run)); later features add theirs there."""

import argparse
import sys


def _consolidate_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("checkpoint_dir", help="the path passed to nxd_hf.save_checkpoint")
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


SUBCOMMANDS = {
    "consolidate": ("write a checkpoint's model as a plain Hugging Face model directory", _consolidate_args, _consolidate),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="nxd-hf", description="nxd_hf command-line tools")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, (help_text, add_arguments, _) in SUBCOMMANDS.items():
        add_arguments(commands.add_parser(name, help=help_text, description=help_text))
    args = parser.parse_args(argv)
    try:
        SUBCOMMANDS[args.command][2](args)
    except ValueError as error:
        print(f"nxd-hf {args.command}: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
