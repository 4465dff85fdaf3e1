"""`python -m sparrow.bench.rollout rollout|rollout-merge|decode-step|rollout-paper ...` (the CLI without its other commands)."""


def main(argv: list[str] | None = None) -> int:
    import argparse

    from .cli import register_decode_step, register_rollout, register_rollout_merge, register_rollout_paper

    parser = argparse.ArgumentParser(prog="python -m sparrow.bench.rollout")
    actions = parser.add_subparsers(dest="action", required=True)
    register_rollout(actions)
    register_rollout_merge(actions)
    register_decode_step(actions)
    register_rollout_paper(actions)
    args = parser.parse_args(argv)
    return args.handler(args)


if __name__ == "__main__":
    raise SystemExit(main())
