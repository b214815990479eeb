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
from memexp.trainer import Trainer, build, device_name

log = logging.getLogger("memexp")


def run(cfg: DictConfig) -> dict:
    """The task function: importable, so submitit can pickle it by reference."""
    hydra_cfg = HydraConfig.get()
    run_dir = Path(hydra_cfg.runtime.output_dir)
    record = RunRecord(
        run_dir / "result.json",
        config=OmegaConf.to_container(cfg, resolve=True),
        choices=dict(hydra_cfg.runtime.choices),
        overrides=list(hydra_cfg.overrides.task),
    )
    # A sweep's jobs share a group: the sweep folder's name.
    multirun = hydra_cfg.mode == RunMode.MULTIRUN
    group = Path(hydra_cfg.sweep.dir).name if multirun else run_dir.name
    logger = NoLogger()  # until the configured one is built, inside the record's try
    try:
        logger = build(cfg.logger)
        record.payload["logger"] = logger.start(RunInfo(
            run_dir, record.payload["config"], record.payload["techniques"], group))
        trainer = Trainer(cfg)
        record.payload["env"]["device_name"] = device_name(trainer.device)
        metrics = trainer.fit(logger)
        record.finish("ok", memory=trainer.meter.report(), metrics=trainer.summary_metrics(metrics))
    except BaseException as error:
        record.finish("failed", error=error)
        logger.finish(record.payload, exit_code=1)
        log.error(summary(record.payload, run_dir))
        raise
    logger.finish(record.payload, exit_code=0)
    log.info("\n" + summary(record.payload, run_dir))
    return record.payload


def main() -> None:
    hydra.main(version_base="1.3", config_path=str(config_dir()), config_name="train")(run)()
