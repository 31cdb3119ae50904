"""The single-process reference and the per-rank step runner every layout test holds against it: losses,
grad norms, the full state, the ledger's rows per step."""
from fivefold.config import Config
from fivefold.train.trainer import Trainer


def run_steps(rank, world, cfg_dict, steps=3):
    """Train `steps` steps; return per-step losses, the full state and this rank's ledger rows per step."""
    tr = Trainer(Config.from_dict(cfg_dict), rank, world, quiet=True)
    losses, norms, per_step = [], [], []
    for k in range(steps):
        snap = tr.ledger.snapshot()
        m = tr.step(k)
        losses.append(m["loss"])
        norms.append(m["grad_norm"])
        per_step.append(tr.ledger.since(snap).rows())
    n_params = tr.n_params
    return {"losses": losses, "grad_norms": norms, "state": tr.full_state()["model"], "ledger": per_step, "params": n_params,
            "state_bytes": tr.model_state_bytes(), "activations": tr.activations.peak}


def run_many(rank, world, cfg_dicts, steps=3):
    """run_steps for several configs in one spawn (saves a process start per config)."""
    return [run_steps(rank, world, d, steps) for d in cfg_dicts]


def reference(cfg: Config, steps=3):
    return run_steps(0, 1, cfg.to_dict(), steps)

