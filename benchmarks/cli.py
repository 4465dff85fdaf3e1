"""`sparrow bench ...`: the benchmarks (each prints a table; the GPU ones write JSON to benchmarks/results/).
Each bench registers its own options where it lives; this command only gathers them. `sparrow.cli.main` imports
this module only when `sparrow bench` runs."""

from .decode_kernels.cli import register as register_kernels
from .handoff import register as register_handoff
from .publish import register as register_publish
from .rl_step import register as register_rl_step
from .rollout.engine_run import register as register_rollout_engine
from .rollout.cli import register_decode_step, register_rollout, register_rollout_merge, register_rollout_paper
from .tail_model import register as register_tail_model
from .trainer import register as register_trainer


def configure(p) -> None:
    actions = p.add_subparsers(dest="bench_command", metavar="ACTION", required=True)
    register_rollout(actions)
    register_rollout_merge(actions)
    register_rollout_engine(actions)
    register_kernels(actions)
    register_decode_step(actions)
    register_rollout_paper(actions)
    register_trainer(actions)
    register_publish(actions)
    register_handoff(actions)
    register_rl_step(actions)
    register_tail_model(actions)
