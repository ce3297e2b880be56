"""``run.sinks``: a metrics-sink factory. Writes every metric it receives to ``<run dir>/metrics.csv`` as
``step,name,value`` rows (long format: records differ in their keys, e.g. the step-0 eval has only eval/*)."""

import csv


class CsvSink:
    """A ``MetricsSink``: ``log(metrics, step)`` appends a row per metric; ``close()``."""

    def __init__(self, path):
        new = not path.exists()
        self._file = open(path, "a", newline="")
        self._writer = csv.writer(self._file)
        if new:
            self._writer.writerow(["step", "name", "value"])

    def log(self, metrics, step):
        for name, value in sorted(metrics.items()):
            self._writer.writerow([step, name, value])
        self._file.flush()

    def close(self):
        self._file.close()


def build_csv_sink(context):
    """(context: RunContext) -> MetricsSink."""
    return CsvSink(context.run_dir / "metrics.csv")
