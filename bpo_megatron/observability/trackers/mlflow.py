"""MLflow: by default a file store in ``<run_dir>/mlflow`` (``mlflow ui --backend-store-uri
<run_dir>/mlflow``), or any tracking URI in ``logging.mlflow_uri``.

MLflow refuses some characters in metric names that ours use (``eval/mean_avg@4``): those are
spelled out (:func:`mlflow_metric_name`: ``@`` -> ``_at_``, anything else refused -> ``_``).
Params cannot change once logged, so a resume that changes a (resume-safe) setting records the
new value as the tag ``resumed_at_step_N.<setting>``.
"""

from __future__ import annotations

import os
import re
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from bpo_megatron.observability.trackers import TrackedRun, Tracker, TrackerWarning, flat_config

BATCH = 100  # MLflow's limit of params (and tags) in one log_batch
ALLOWED = re.compile(r"[\w\-. :/]")  # MLflow's metric name characters (mlflow.utils.validation)
SPELLED = {"@": "_at_"}


def mlflow_metric_name(name: str) -> str:
    return "".join(ch if ALLOWED.fullmatch(ch) else SPELLED.get(ch, "_") for ch in name)


def default_uri(run_dir: Path) -> str:
    return (run_dir / "mlflow").resolve().as_uri()


def is_file_store(uri: str) -> bool:
    return "://" not in uri or uri.startswith("file:")


@contextmanager
def file_store_allowed(uri: str) -> Iterator[None]:
    """MLflow 3.x refuses its file store unless ``MLFLOW_ALLOW_FILE_STORE=true``, which it reads
    from the environment only, when the store is built (the store is then cached per URI): set
    for that moment when the URI is a file store and the user has not set it, then restored."""
    key = "MLFLOW_ALLOW_FILE_STORE"
    if not is_file_store(uri) or key in os.environ:
        yield
        return
    os.environ[key] = "true"
    try:
        yield
    finally:
        os.environ.pop(key, None)


def client(uri: str):
    """An ``MlflowClient`` of ``uri`` (file stores allowed)."""
    from mlflow.tracking import MlflowClient

    with file_store_allowed(uri):
        return MlflowClient(tracking_uri=uri)


class MlflowTracker(Tracker):
    package = "mlflow"
    def __init__(self, run: TrackedRun, recorded: dict[str, Any]) -> None:
        from mlflow.entities import Param, RunTag
        from mlflow.exceptions import MlflowException
        from mlflow.utils.validation import MAX_PARAM_VAL_LENGTH

        settings = run.settings
        self._uri = settings.mlflow_uri or default_uri(run.run_dir)
        self._client = client(self._uri)
        run_id = recorded.get("run_id") if recorded.get("uri") == self._uri else None
        existing = None
        if run_id:
            try:
                existing = self._client.get_run(run_id)
            except MlflowException:
                import warnings

                warnings.warn(f"tracker mlflow: the recorded run {run_id} is not in {self._uri}; a new run holds "
                              "this run's metrics from the start", TrackerWarning, stacklevel=2)
        self.continued = existing is not None
        params = {k: str(v)[:MAX_PARAM_VAL_LENGTH] for k, v in flat_config(run.config).items()}
        tags = {}
        if existing is None:
            experiment = self._client.get_experiment_by_name(settings.mlflow_experiment)
            experiment_id = (experiment.experiment_id if experiment is not None
                             else self._client.create_experiment(settings.mlflow_experiment))
            identity = {"bpo.run_dir": str(run.run_dir)}
            if run.git_commit:
                identity["mlflow.source.git.commit"] = run.git_commit
            self._run_id = self._client.create_run(experiment_id, run_name=run.name, tags=identity).info.run_id
        else:
            self._run_id = run_id
            self._client.update_run(run_id, status="RUNNING")
            logged = existing.data.params
            changed = {k: v for k, v in params.items() if k in logged and logged[k] != v}
            tags = {f"resumed_at_step_{run.resume_after}.{k}": v for k, v in changed.items()}
            params = {k: v for k, v in params.items() if k not in logged}
        items = [Param(k, v) for k, v in params.items()]
        for start in range(0, len(items), BATCH):
            self._client.log_batch(self._run_id, params=items[start:start + BATCH])
        tag_items = [RunTag(k, v) for k, v in tags.items()]
        for start in range(0, len(tag_items), BATCH):
            self._client.log_batch(self._run_id, tags=tag_items[start:start + BATCH])

    def record(self) -> dict[str, Any]:
        return {"run_id": self._run_id, "uri": self._uri}

    def log(self, step: int, metrics: dict[str, float], time: float) -> None:
        from mlflow.entities import Metric

        stamp = int(time * 1000)
        points = [Metric(mlflow_metric_name(k), float(v), stamp, step) for k, v in metrics.items()]
        self._client.log_batch(self._run_id, metrics=points)

    def close(self, *, failed: bool) -> None:
        self._client.set_terminated(self._run_id, status="FAILED" if failed else "FINISHED")
