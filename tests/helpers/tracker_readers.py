"""Read what the trackers wrote with their own tools: W&B's offline run files through
``wandb.sdk.internal.datastore`` (the reader ``wandb sync`` used) and MLflow's store through
``MlflowClient``."""

from __future__ import annotations

import json
import os
from pathlib import Path


def wandb_history(run_dir) -> list:
    """Every history row (``{"_step": ..., key: value}``) of every offline segment of the run
    under ``<run_dir>/wandb``, in file order (a resumed run adds a segment)."""
    from wandb.proto import wandb_internal_pb2 as pb
    from wandb.sdk.internal import datastore

    rows = []
    files = sorted(Path(run_dir, "wandb").glob("offline-run-*/run-*.wandb"))
    assert files, f"no W&B offline run under {run_dir}/wandb"
    for f in files:
        ds = datastore.DataStore()
        ds.open_for_scan(str(f))
        while (data := ds.scan_data()) is not None:
            rec = pb.Record()
            rec.ParseFromString(data)
            if rec.WhichOneof("record_type") == "history":
                rows.append(
                    {
                        item.key or "/".join(item.nested_key): json.loads(item.value_json)
                        for item in rec.history.item
                    }
                )
    return rows


def mlflow_client(run_dir):
    """An ``MlflowClient`` on the run's default local store and the run id it logged to."""
    from mlflow.tracking import MlflowClient

    os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    state = json.loads(Path(run_dir, "mlflow_run.json").read_text())
    return MlflowClient(tracking_uri=state["tracking_uri"]), state["run_id"]
