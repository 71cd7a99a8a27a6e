"""The ``nxd-hf`` command: one function per subcommand.

    nxd-hf check MODEL_DIR --tp N [--pp P] [--sp]
"""

import argparse
import sys


def check(args: argparse.Namespace) -> int:
    """Parity of MODEL_DIR's architecture (shrunk) on the layout: loss and every gradient."""
    from nxd_hf.testing.check import check_parity

    result = check_parity(args.model_dir, tensor_parallel_size=args.tp, pipeline_parallel_size=args.pp,
                          sequence_parallel=args.sp)
    layout = f"tp={args.tp} pp={args.pp}" + (" sp" if args.sp else "")
    print(f"{args.model_dir} ({layout}): {result.status}")
    if result.max_loss_diff is not None:
        print(f"  max |loss diff| {result.max_loss_diff:.2e}, max |grad diff| {result.max_grad_diff:.2e}")
    if result.message:
        print(f"  {result.message}")
    return 0 if result.status == "pass" else 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="nxd-hf", description="nxd_hf tools")
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("check", help=check.__doc__)
    p.add_argument("model_dir", help="a directory (or hub id) holding the model's config.json")
    p.add_argument("--tp", type=int, required=True, help="tensor_parallel_size")
    p.add_argument("--pp", type=int, default=1, help="pipeline_parallel_size")
    p.add_argument("--sp", action="store_true", help="sequence parallelism")
    p.set_defaults(run=check)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    return args.run(args)


if __name__ == "__main__":
    sys.exit(main())
