"""The Hydra application behind `train.py`: one run, recorded in result.json whatever happens."""

from __future__ import annotations

import logging
from pathlib import Path

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, OmegaConf

from memexp.config import config_dir
from memexp.loggers import NoLogger, RunInfo
from memexp.result import RunRecord, summary
from memexp.trainer import NonFiniteLoss, OutOfMemory, Trainer, build, device_name, is_out_of_memory

log = logging.getLogger("memexp")


def status_of(error: BaseException) -> str:
    """How a run that raised ended: out of memory, diverged, or failed."""
    if isinstance(error, OutOfMemory) or is_out_of_memory(error):
        return "oom"
    return "nan" if isinstance(error, NonFiniteLoss) else "failed"


def run_config(cfg: DictConfig, run_dir: Path, choices: dict[str, str], overrides: list[str],
               group: str) -> dict:
    """Build, train and record one run in `run_dir`; raises after recording a failure."""
    record = RunRecord(run_dir / "result.json", config=OmegaConf.to_container(cfg, resolve=True),
                       choices=choices, overrides=overrides)
    logger, trainer = NoLogger(), None  # until built, inside the record's try
    try:
        logger = build(cfg.logger)
        record.payload["logger"] = logger.start(RunInfo(
            run_dir, record.payload["config"], record.payload["techniques"], group,
            resume=cfg.trainer.resume == "auto"))
        trainer = Trainer(cfg, run_dir)
        record.payload["env"]["device_name"] = device_name(trainer.device)
        trainer.fit(logger)
        record.finish("ok", memory=trainer.meter.report(), metrics=trainer.summary_metrics())
    except BaseException as error:
        memory = trainer.meter.report() if trainer is not None else None
        if memory is not None and isinstance(error, OutOfMemory):
            memory["oom"] = {"phase": error.phase, "step": error.step}
        metrics = trainer.summary_metrics() if trainer is not None else None
        record.finish(status_of(error), memory=memory, metrics=metrics, error=error)
        logger.finish(record.payload, exit_code=1)
        log.error(summary(record.payload, run_dir))
        raise
    logger.finish(record.payload, exit_code=0)
    log.info("\n" + summary(record.payload, run_dir))
    return record.payload


def run(cfg: DictConfig) -> dict:
    """The Hydra task function: importable, so submitit can pickle it by reference."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    # A sweep's jobs share a group: the sweep folder's name.
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    group = Path(hydra_cfg.sweep.dir).name if multirun else run_dir.name
    return run_config(cfg, run_dir, dict(hydra_cfg.runtime.choices),
                      list(hydra_cfg.overrides.task), group)


def main() -> None:
    hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")(run)()
