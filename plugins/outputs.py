"""Built-in outputs of a node diagnosis: JSON, Prometheus textfile, node-problem-detector, webhook.

Each is an `Output`: constructed with string options, `emit(document)` delivers one `gpuguard.node/1`
document and returns a short note (or raises: the registry reports and skips it). They are registered
as `gpuguard.outputs` entry points in pyproject.toml, exactly as a third-party output would be.
The renderers (`npd_line`, `nagios_text`, `webhook_payload`, `prometheus_registry`) are pure functions
of the document, so the CLI formats and the plugins share one implementation.

Lazy imports (start-up time): prometheus_client and requests, only when that output runs.
"""

from __future__ import annotations

import functools
import json
import sys
import time
from collections.abc import Mapping
from datetime import datetime, timezone
from typing import Any

from gpuguard.foundation.deadline import DeadlineExceeded, call_with_deadline
from gpuguard.foundation.errors import (
    EXIT_CRITICAL,
    EXIT_OK,
    EXIT_UNKNOWN,
    EXIT_WARNING,
    UnavailableError,
    UsageError,
)
from gpuguard.foundation.outfile import write_output_file

NAGIOS_EXIT = {
    "healthy": EXIT_OK,
    "degraded": EXIT_WARNING,
    "reset": EXIT_CRITICAL,
    "drain": EXIT_CRITICAL,
    "unknown": EXIT_UNKNOWN,
}
NAGIOS_STATE = {EXIT_OK: "OK", EXIT_WARNING: "WARNING", EXIT_CRITICAL: "CRITICAL", EXIT_UNKNOWN: "UNKNOWN"}
# node-problem-detector custom plugins: 0 OK, 1 NonOK, anything else Unknown (we use 2).
NPD_EXIT = {"healthy": 0, "degraded": 1, "reset": 1, "drain": 1, "unknown": 2}
NPD_MAX = 80
SEVERITY = {"healthy": "info", "degraded": "warning", "reset": "critical", "drain": "critical", "unknown": "warning"}


def identity_tag(doc: Mapping[str, Any]) -> str:
    """` [b:1a2b3c4d s:1324020012340 t:11:40-11:45Z]`: whose verdict a short message is (the boot, the
    serial of the first GPU with the verdict, the evidence's time range), in as few characters as it takes."""
    identity = doc.get("identity") or {}
    parts = []
    if identity.get("boot_id"):
        parts.append(f"b:{str(identity['boot_id'])[:8]}")
    verdict = doc.get("verdict")
    serial = next(
        (g.get("serial") for g in doc.get("gpus") or [] if g.get("verdict") == verdict and g.get("serial")), None
    )
    if serial:
        parts.append(f"s:{serial}")
    first, last = str(identity.get("evidence_from") or ""), str(identity.get("evidence_to") or "")
    if first:
        parts.append(f"t:{first[11:16]}" + (f"-{last[11:16]}" if last and last[11:16] != first[11:16] else "") + "Z")
    return f" [{' '.join(parts)}]" if parts else ""


def npd_line(doc: Mapping[str, Any]) -> tuple[int, str]:
    """(exit code, one line of at most 80 characters) for node-problem-detector, ending with whose verdict
    it is (`identity_tag`), which the summary makes room for."""
    verdict = doc.get("verdict", "unknown")
    text = (
        f"{verdict}: {doc.get('summary', '')}"
        if not str(doc.get("summary", "")).startswith(verdict)
        else str(doc.get("summary"))
    )
    text = " ".join(text.split())
    tag = identity_tag(doc) if verdict != "healthy" else ""
    if len(tag) > NPD_MAX // 2:
        tag = ""
    room = NPD_MAX - len(tag)
    if len(text) > room:
        text = text[: room - 3] + "..."
    return NPD_EXIT.get(verdict, 2), text + tag


def _perf_label(label: str) -> str:
    return f"'{label.replace(chr(39), chr(39) * 2)}'" if any(c in label for c in " ='") else label


def nagios_text(doc: Mapping[str, Any]) -> tuple[int, str]:
    """(exit code, `GPU <STATE> - text | perfdata`) following the Nagios plugin API."""
    verdict = doc.get("verdict", "unknown")
    code = NAGIOS_EXIT.get(verdict, EXIT_UNKNOWN)
    gpus = doc.get("gpus") or []
    counts = {v: sum(1 for g in gpus if g.get("verdict") == v) for v in NAGIOS_EXIT}
    perf = [("gpus", f"{len(gpus)};;;0")] + [(v, f"{n};;;0") for v, n in counts.items()]
    perf.append(("xid_events", f"{(doc.get('counts') or {}).get('events_in_window', 0)}c"))
    duration = doc.get("duration_s")
    if isinstance(duration, (int, float)):
        perf.append(("duration", f"{duration:.3f}s"))
    summary = " ".join(str(doc.get("summary", "")).replace("|", "/").split())
    lines = [f"GPU {NAGIOS_STATE[code]} - {summary} | {' '.join(f'{_perf_label(k)}={v}' for k, v in perf)}"]
    for g in gpus:
        if g.get("verdict") not in ("healthy",):
            ev = g.get("evidence") or []
            first = next((e for e in ev if e.get("verdict") == g.get("verdict")), ev[0] if ev else {})
            lines.append(
                f"GPU{g.get('index') if g.get('index') is not None else '?'} {g.get('pci_bus_id')}: "
                f"{g.get('verdict')} - {str(first.get('message', '')).replace('|', '/')}"
            )
    return code, "\n".join(lines)


ALERT_NAME = "GpuNodeHealth"
ALERT_SEVERITIES = ("warning", "critical")  # the severities a node alert fires with (SEVERITY's non-info values)


def alert_labels(node: str, severity: str) -> dict[str, str]:
    """An alert's identity: the node and the severity, never the verdict, the boot or the evidence (which
    change while the problem lasts): the post that resolves an alert carries exactly the labels it fired with."""
    return {"alertname": ALERT_NAME, "node": node, "severity": severity}


def _rfc3339(t: float) -> str:
    return datetime.fromtimestamp(t, timezone.utc).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def webhook_payload(doc: Mapping[str, Any], *, now: float | None = None) -> list[dict[str, Any]]:
    """The body of Alertmanager's `POST /api/v2/alerts` (a JSON array of postable alerts) for one document.

    Each post says the whole state, so no sender needs to remember the last one: the node's alert at its
    verdict's severity fires (no `endsAt`: Alertmanager keeps it for its `resolve_timeout` and every sweep or
    watcher judgement posts it again), and the node's alert at every other severity is resolved (`endsAt`
    now): a healthy node resolves whatever fired, and a node that went from degraded (warning) to drain
    (critical) leaves no warning behind."""
    t = time.time() if now is None else now
    verdict = str(doc.get("verdict", "unknown"))
    node = str(doc.get("node") or "unknown")
    severity = SEVERITY.get(verdict, "warning")
    identity = doc.get("identity") or {}
    annotations = {
        "summary": str(doc.get("summary", "")),
        "description": str(doc.get("action", "")),
        "verdict": verdict,
    }
    if identity.get("boot_id"):
        annotations["boot_id"] = str(identity["boot_id"])
    if identity.get("evidence_from"):
        annotations["evidence"] = f"{identity['evidence_from']} .. {identity.get('evidence_to')}"
    serials = [
        f"GPU{g.get('index')} {g['serial']}"
        for g in doc.get("gpus") or []
        if g.get("serial") and g.get("verdict") != "healthy"
    ]
    if serials:
        annotations["gpu_serials"] = ", ".join(serials)
    alerts = []
    for sev in ALERT_SEVERITIES:
        alert: dict[str, Any] = {
            "labels": alert_labels(node, sev),
            "annotations": annotations,
            "startsAt": _rfc3339(t),
            "generatorURL": "",
        }
        if sev != severity:
            alert["endsAt"] = _rfc3339(t)  # resolved: not (or no longer) at this severity
        alerts.append(alert)
    return alerts


def prometheus_registry(doc: Mapping[str, Any]) -> Any:
    """A dedicated CollectorRegistry holding the document's metrics (names follow Prometheus practice)."""
    from prometheus_client import CollectorRegistry
    from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

    class _NodeCollector:
        def collect(self):  # noqa: ANN202 - prometheus_client protocol
            verdict = doc.get("verdict", "unknown")
            fam = GaugeMetricFamily(
                "gpudoctor_node_verdict", "1 for the node's current verdict, 0 otherwise.", labels=["verdict"]
            )
            for v in NAGIOS_EXIT:
                fam.add_metric([v], 1.0 if v == verdict else 0.0)
            yield fam
            status = GaugeMetricFamily(
                "gpudoctor_check_status",
                "Result of a health check (0=ok,1=warning,2=critical,3=unknown).",
                labels=["check"],
            )
            status.add_metric(["node"], float(NAGIOS_EXIT.get(verdict, 3)))
            for name, sec in (doc.get("sections") or {}).items():
                # a dimension a replay did not examine (no NVML snapshot given) is not a failed check
                if isinstance(sec, Mapping) and "status" in sec and sec["status"] != "not_examined":
                    status.add_metric([name], 0.0 if sec["status"] == "ok" else 3.0)
            yield status
            gv = GaugeMetricFamily(
                "gpudoctor_gpu_verdict",
                "1 for each GPU's current verdict, 0 otherwise.",
                labels=["gpu", "pci_bus_id", "verdict"],
            )
            for g in doc.get("gpus") or []:
                for v in NAGIOS_EXIT:
                    gv.add_metric(
                        [_label(g.get("index")), _label(g.get("pci_bus_id")), v],
                        1.0 if g.get("verdict") == v else 0.0,
                    )
            yield gv
            yield from _nvml_families(doc, GaugeMetricFamily, _NVML_GAUGES)
            yield from _nvml_families(doc, CounterMetricFamily, _NVML_COUNTERS)
            xid = CounterMetricFamily(  # exposed as gpudoctor_gpu_xid_events_total
                "gpudoctor_gpu_xid_events",
                "Xid events seen in the kernel log, by GPU and code.",
                labels=["pci_bus_id", "xid"],
            )
            for key, value in sorted((doc.get("xid_totals") or {}).items()):
                pci, _, code = key.rpartition("|")
                xid.add_metric([pci, code], float(value))
            yield xid
            lost = CounterMetricFamily(  # gpudoctor_gpu_lost_events_total
                "gpudoctor_gpu_lost_events",
                "GPU-lost events (Xid 79, fallen off the bus) seen in the kernel log, by GPU.",
                labels=["pci_bus_id"],
            )
            for pci, value in sorted((doc.get("gpu_lost_totals") or {}).items()):
                lost.add_metric([_label(pci)], float(value))
            yield lost
            faults = CounterMetricFamily(  # gpudoctor_gpu_fault_events_total
                "gpudoctor_gpu_fault_events",
                "GPU faults without an Xid (init failure, PCIe AER, Fabric Manager, ...) seen in the logs.",
                labels=["pci_bus_id", "fault"],
            )
            for key, value in sorted((doc.get("fault_totals") or {}).items()):
                pci, _, fault = key.rpartition("|")
                faults.add_metric([pci, fault], float(value))
            yield faults
            yield from _identity_families(doc, GaugeMetricFamily)
            run = GaugeMetricFamily("gpudoctor_last_run_timestamp_seconds", "Unix time the diagnosis finished.")
            run.add_metric([], float(doc.get("generated_at_unix") or time.time()))
            yield run
            if isinstance(doc.get("duration_s"), (int, float)):
                dur = GaugeMetricFamily("gpudoctor_run_duration_seconds", "Wall time of the diagnosis.")
                dur.add_metric([], float(doc["duration_s"]))
                yield dur

    registry = CollectorRegistry(auto_describe=False)
    registry.register(_NodeCollector())
    return registry


def _unix(text: Any) -> float | None:
    try:
        return datetime.fromisoformat(str(text)).timestamp() if text else None
    except ValueError:
        return None


def _identity_families(doc: Mapping[str, Any], gauge: Any):
    """Whose verdict the metrics are: the node's boot, each GPU's UUID and serial, the evidence's time range."""
    identity = doc.get("identity") or {}
    info = gauge("gpudoctor_node_info", "1, labelled with the node and its boot id.", labels=["node", "boot_id"])
    info.add_metric([_label(doc.get("node")), _label(identity.get("boot_id"))], 1.0)
    yield info
    gpus = gauge(
        "gpudoctor_gpu_info", "1 per GPU, labelled with its identity.", labels=["gpu", "pci_bus_id", "uuid", "serial"]
    )
    for g in doc.get("gpus") or []:
        gpus.add_metric([_label(g.get(k)) for k in ("index", "pci_bus_id", "uuid", "serial")], 1.0)
    yield gpus
    for key, name in (("evidence_from", "first"), ("evidence_to", "last")):
        when = _unix(identity.get(key))
        if when is not None:
            fam = gauge(f"gpudoctor_evidence_{name}_timestamp_seconds", f"Unix time of the {name} evidence judged.")
            fam.add_metric([], when)
            yield fam


_NVML_GAUGES = (
    ("gpudoctor_gpu_lost", "1 if NVML reports the GPU as lost.", lambda g: g.get("lost")),
    (
        "gpudoctor_gpu_row_remap_pending",
        "1 if the GPU has a row remap pending (reset required to apply).",
        lambda g: (g.get("remapped_rows") or {}).get("pending"),
    ),
    (
        "gpudoctor_gpu_row_remap_failure",
        "1 if a row remapping ever failed on the GPU.",
        lambda g: (g.get("remapped_rows") or {}).get("failure"),
    ),
    ("gpudoctor_gpu_temperature_celsius", "GPU temperature.", lambda g: g.get("temperature_c")),
    ("gpudoctor_gpu_power_watts", "GPU power draw.", lambda g: g.get("power_w")),
    ("gpudoctor_gpu_pcie_link_width", "Current PCIe link width.", lambda g: (g.get("pcie") or {}).get("width")),
    ("gpudoctor_gpu_pcie_link_width_max", "Maximum PCIe link width.", lambda g: (g.get("pcie") or {}).get("width_max")),
    (
        "gpudoctor_gpu_recovery_action",
        "Driver GPU recovery action (0 none, 1 reset, 2 reboot, 4 drain+reset).",
        lambda g: g.get("recovery_action"),
    ),
)


# NVML's counters only grow (the volatile ones restart at a driver load / GPU reset, which Prometheus'
# rate() treats as a counter reset): counters, exposed with the _total suffix.
_NVML_COUNTERS = (
    (
        "gpudoctor_gpu_ecc_volatile_uncorrected_errors",
        "Uncorrectable ECC errors since the last driver load or reset.",
        lambda g: (g.get("ecc") or {}).get("volatile_uncorrected"),
    ),
    (
        "gpudoctor_gpu_ecc_aggregate_uncorrected_errors",
        "Lifetime uncorrectable ECC errors.",
        lambda g: (g.get("ecc") or {}).get("aggregate_uncorrected"),
    ),
    (
        "gpudoctor_gpu_pcie_replays",
        "PCIe replay counter (link-level retransmissions).",
        lambda g: (g.get("pcie") or {}).get("replay_counter"),
    ),
)


def _label(value: Any) -> str:
    """A label value: an absent one is empty (never the string "None")."""
    return "" if value is None else str(value)


def _nvml_families(doc: Mapping[str, Any], family: Any, specs: Any):
    gpus = (doc.get("nvml") or {}).get("gpus") or []
    for name, help_text, get in specs:
        fam = family(name, help_text, labels=["gpu", "pci_bus_id", "uuid"])
        for g in gpus:
            value = get(g)
            if value is not None:
                fam.add_metric(
                    [_label(g.get("index")), _label(g.get("pci_bus_id")), _label(g.get("uuid"))], float(value)
                )
        yield fam


def write_textfile(path: str, doc: Mapping[str, Any], *, what: str = "prometheus output") -> None:
    """Write the metrics through the one output writer (`foundation.outfile.write_output_file`):
    a temp file opened through a no-follow handle on the directory, renamed over the old file; the
    directory is never created, a link (the file or its directory) is refused, never written
    through (prometheus_client's own writer follows links and needs the directory made for it)."""
    from prometheus_client import generate_latest

    if not str(path).endswith(".prom"):
        raise UsageError(f"textfile {path}: the node_exporter textfile collector only reads *.prom files")
    write_output_file(str(path), generate_latest(prometheus_registry(doc)), force=True, what=what)


def post_webhook(
    url: str, payload: Mapping[str, Any] | list[Any], *, timeout: float = 5.0, retries: int = 2, budget: float = 15.0
) -> str:
    """POST with a per-try timeout, bounded retries and a total budget; raise UnavailableError when spent.

    `timeout` and `budget` are wall-clock deadlines over connect, send and the whole response read
    (requests' own timeout is per socket read: a server that trickles its answer one byte a second
    would never trip it). A try past its deadline is abandoned (`call_with_deadline`), so this
    returns within `budget` plus a few milliseconds, and the sweep's lock is never held past it.
    """
    import requests

    if not url.startswith(("http://", "https://")):
        raise UsageError(f"webhook {url!r}: only http:// and https:// URLs are supported")
    deadline = time.monotonic() + budget
    body = json.dumps(payload, default=str).encode()
    last = "not attempted"
    for attempt in range(retries + 1):
        left = deadline - time.monotonic()
        if left <= 0.05:
            break
        per_try = min(timeout, left)
        try:
            resp = call_with_deadline(
                functools.partial(
                    requests.post, url, data=body, headers={"Content-Type": "application/json"}, timeout=per_try
                ),
                per_try,
                name="gpuguard-webhook",
            )
        except DeadlineExceeded:
            last = f"no complete answer within {per_try:g} s"
        except requests.RequestException as exc:
            last = type(exc).__name__
        else:
            if resp.status_code < 300:
                return f"HTTP {resp.status_code} after {attempt + 1} attempt(s)"
            last = f"HTTP {resp.status_code}"
            if resp.status_code < 500 and resp.status_code != 429:
                raise UnavailableError(f"webhook {url}: {last} (not retried)")
        pause = min(0.5 * 2**attempt, deadline - time.monotonic())
        if attempt < retries and pause > 0:
            time.sleep(pause)
    raise UnavailableError(f"webhook {url}: gave up after {attempt + 1} attempt(s) ({last})")


class Output:
    """Base of every output plugin: `Output(options).emit(document) -> note`."""

    name = "output"
    description = ""

    def __init__(self, options: Mapping[str, str] | None = None) -> None:
        self.options = dict(options or {})

    def emit(self, document: Mapping[str, Any]) -> str:  # pragma: no cover - interface
        raise NotImplementedError


class JsonOutput(Output):
    name = "json"
    description = "the gpuguard.node/1 document, to stdout or to path=FILE (replaced atomically, never through a link)"

    def emit(self, document: Mapping[str, Any]) -> str:
        text = json.dumps(document, indent=2, default=str) + "\n"
        path = self.options.get("path")
        if not path:
            sys.stdout.write(text)
            return "stdout"

        write_output_file(path, text.encode(), force=True, what="json output")
        return path


class PrometheusTextfileOutput(Output):
    name = "prometheus"
    description = "node_exporter textfile (path=DIR/gpudoctor.prom), replaced atomically, never through a link"

    def emit(self, document: Mapping[str, Any]) -> str:
        path = self.options.get("path")
        if not path:
            raise UsageError("prometheus output needs path=FILE.prom")
        write_textfile(path, document)
        return path


class NodeProblemDetectorOutput(Output):
    name = "npd"
    description = "node-problem-detector line (<= 80 chars) to stdout"

    def emit(self, document: Mapping[str, Any]) -> str:
        code, line = npd_line(document)
        sys.stdout.write(line + "\n")
        return f"exit {code}"


class WebhookOutput(Output):
    name = "webhook"
    description = "Alertmanager v2 POST /api/v2/alerts (url=, timeout=, retries=, budget=)"

    def emit(self, document: Mapping[str, Any]) -> str:
        url = self.options.get("url")
        if not url:
            raise UsageError("webhook output needs url=URL")
        try:
            timeout = float(self.options.get("timeout", 5))
            retries = int(self.options.get("retries", 2))
            budget = float(self.options.get("budget", 15))
        except ValueError as exc:
            raise UsageError(f"webhook output: bad option ({exc})") from None
        return post_webhook(url, webhook_payload(document), timeout=timeout, retries=retries, budget=budget)
