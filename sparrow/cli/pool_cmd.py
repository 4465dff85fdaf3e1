"""`sparrow pool resize RUN_DIR --rollout N` and `sparrow pool status RUN_DIR [--json]`: a running job's
pools, through the coordinator's ControlService at the address in RUN_DIR/control/endpoint.json
(docs/coordinator.md, "Resizing the rollout pool"). Imports no torch: gRPC and the control client only."""

import argparse
import json
from pathlib import Path

HELP_RUN_DIR = "the run directory of a running `sparrow train` job"


def configure(p) -> None:
    cmds = p.add_subparsers(dest="pool_command", metavar="ACTION", required=True)

    resize = cmds.add_parser("resize", help="set the rollout pool's size; new workers join at the next weights version",
                             description="Set the rollout pool's target size while the job runs. New workers sync the "
                             "current weights and schedule before they take work; a shrink retires the newest workers, "
                             "which finish what they hold.")
    resize.add_argument("run_dir", type=Path, metavar="RUN_DIR", help=HELP_RUN_DIR)
    size = resize.add_mutually_exclusive_group(required=True)
    size.add_argument("--rollout", type=int, metavar="N", help="rollout workers wanted (1 to 1024)")
    size.add_argument("--trainer", type=int, metavar="N", help=argparse.SUPPRESS)  # refused by the job, which says why
    _common(resize)
    resize.set_defaults(handler=run_resize)

    status = cmds.add_parser("status", help="the job's pools: target, serving, joining and retiring workers")
    status.add_argument("run_dir", type=Path, metavar="RUN_DIR", help=HELP_RUN_DIR)
    status.add_argument("--json", action="store_true", help="print the coordinator's Health as JSON")
    _common(status)
    status.set_defaults(handler=run_status)


def _common(p) -> None:
    p.add_argument("--address", metavar="HOST:PORT",
                   help="dial this instead of the address in RUN_DIR/control/endpoint.json (e.g. a port-forward); "
                        "TLS still verifies the job's server name")
    p.add_argument("--timeout", type=float, default=10.0, metavar="S", help="seconds per call (default 10)")


def _call(args, what):
    """`what(client)` against the job's control server, with every failure as one CliError line."""
    import grpc

    from sparrow.cli.main import CliError
    from sparrow.coordinator.transport.client import ControlClient, TransportError
    from sparrow.coordinator.transport.config import RetryConfig, TransportConfig
    from sparrow.coordinator.transport.endpoint import EndpointError, read_endpoint

    try:
        endpoint = read_endpoint(args.run_dir)
    except EndpointError as exc:
        raise CliError(str(exc)) from None
    if args.address:
        endpoint = endpoint.at(args.address)
    config = TransportConfig(retry=RetryConfig(max_attempts=3, initial_backoff_s=0.2, max_backoff_s=1.0))
    try:
        with ControlClient(endpoint.address, config, endpoint.credentials, timeout_s=args.timeout) as client:
            return endpoint, what(client)
    except TransportError as exc:
        code, details = exc.code, exc.details or str(exc)
        where = f"the job's control server at {endpoint.address}"
        if code == grpc.StatusCode.UNAVAILABLE:
            gone = " (that process no longer exists: the job was stopped without cleaning up)" if endpoint.process_gone() else ""
            raise CliError(
                f"cannot reach {where}: {details}. RUN_DIR/control/endpoint.json was {endpoint.describe()}{gone}; "
                "if the job still runs on another node, run this where that address is reachable, or pass --address"
            ) from None
        if code == grpc.StatusCode.UNAUTHENTICATED:
            raise CliError(
                f"{where} refused the token in {args.run_dir}/control/token ({details}); the control files are not "
                "the running job's (a job restarted in RUN_DIR rewrites them: run the command again)"
            ) from None
        if code == grpc.StatusCode.INVALID_ARGUMENT:
            raise CliError(f"the job refused the request: {details}") from None
        if code == grpc.StatusCode.UNIMPLEMENTED:
            raise CliError(f"{where} does not serve this: {details}") from None
        if code == grpc.StatusCode.DEADLINE_EXCEEDED:
            raise CliError(f"{where} did not answer within --timeout {args.timeout:g} s ({details})") from None
        raise CliError(f"{where}: {exc}") from None


def run_resize(args) -> int:
    pool, size = ("rollout", args.rollout) if args.rollout is not None else ("trainer", args.trainer)
    _, (accepted, target, message) = _call(args, lambda client: client.resize_pool(pool, size))
    if not accepted:
        print(f"sparrow pool resize: not done: {message} ({pool} pool target stays {target})")
        return 1
    print(f"{pool} pool: target {target}" + (f"; {message}" if message else ""))
    return 0


def run_status(args) -> int:
    from dataclasses import asdict

    from sparrow.tables import format_table

    endpoint, health = _call(args, lambda client: client.health())
    if args.json:
        print(json.dumps({"address": endpoint.address, **asdict(health)}, indent=1))
        return 0
    print(f"{args.run_dir}: {health.component} at {endpoint.address}, {health.status}, policy version "
          f"{health.policy_version}, schedule v{health.schedule_version}")
    rows = [[p.pool, p.target, p.serving, p.joining, p.retiring, "yes" if p.resizable else "no"] for p in health.pools]
    print(format_table(["pool", "target", "serving", "joining", "retiring", "resizable"], rows))
    return 0
