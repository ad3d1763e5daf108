"""GPU and node faults the driver, the kernel or a training log reports without an Xid code (the
GPU failed to initialise, fell off the bus, a PCIe AER error, the fabric manager, a GSP timeout,
uncorrectable memory): what each means and what an operator should do, on the same severity and
resolution scales as the Xid catalog (`xid_catalog.SEVERITIES`, `xid_catalog.RESOLUTIONS`)."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from gpuguard.foundation.xid_catalog import SEVERITY_ACTION


@dataclass(frozen=True)
class FaultInfo:
    """A GPU / node fault the driver, the kernel or a training log reports without an Xid code."""

    fault: str  # the `fault` field of the event
    name: str
    severity: str  # on the SEVERITIES scale
    resolution: str  # one of RESOLUTIONS
    action: str
    source: str

    def to_json(self) -> dict[str, Any]:
        return {
            "fault": self.fault,
            "name": self.name,
            "severity": self.severity,
            "resolution": self.resolution,
            "action": self.action,
            "source": self.source,
        }


_ECC_RUN = "run `nvidia-smi -q -d ECC,ROW_REMAPPER` on the node"
FAULTS: Mapping[str, FaultInfo] = {
    f.fault: f
    for f in (
        FaultInfo(
            "init_failed",
            "GPU initialisation failed",
            "drain",
            "reboot_node",
            "The driver could not initialise this GPU (RmInitAdapter failed / Cannot attach gpu / No devices were "
            "found): the GPU is unusable. Drain the node, check `lspci -d 10de:` and `nvidia-smi -q`, reboot; if it "
            "stays, check seating, power and SBIOS, then RMA.",
            "NVIDIA driver messages (NVRM: RmInitAdapter failed); NVIDIA Xid catalog: Xid 143 (GPU initialization "
            "error) is RESET_GPU / CONTACT_SUPPORT",
        ),
        FaultInfo(
            "unreachable",
            "GPU does not answer (device handle: Unknown Error)",
            "drain",
            "reboot_node",
            "nvidia-smi cannot open the GPU (Unknown Error / GPU is lost): like Xid 79. Drain the node and reboot; "
            "check the PCIe link (AER errors above), power and seating; RMA if it repeats.",
            "NVIDIA Xid catalog, Xid 79 practical notes (nvidia-smi: Unable to determine the device handle)",
        ),
        FaultInfo(
            "pcie_fatal",
            "PCIe uncorrected fatal error (AER)",
            "drain",
            "reboot_node",
            "A fatal PCIe error on the GPU or the bridge above it: the GPU is (or will fall) off the bus. Drain the "
            "node and reboot; check risers, seating and the PCIe switch; RMA if it repeats.",
            "Linux PCIe AER (Documentation/PCI/pcieaer-howto.rst): fatal = link unreliable, reset needed",
        ),
        FaultInfo(
            "pcie_nonfatal",
            "PCIe uncorrected non-fatal error (AER)",
            "reset",
            "reset_gpu",
            "An uncorrected (non-fatal) PCIe error on the GPU or its bridge: a transaction was lost. Stop the GPU's "
            "processes and reset it (nvidia-smi -r -i <id>); repeats: check the link and the slot.",
            "Linux PCIe AER (Documentation/PCI/pcieaer-howto.rst): non-fatal = this transaction unreliable",
        ),
        FaultInfo(
            "pcie_corrected",
            "PCIe corrected error (AER)",
            "info",
            "ignore",
            "Corrected by the link layer: no action. Many of them on one GPU: watch its PCIe replay counter and "
            "link width (nvidia-smi -q -d PCIE).",
            "Linux PCIe AER (Documentation/PCI/pcieaer-howto.rst): corrected = no functional impact",
        ),
        FaultInfo(
            "fabric_manager",
            "Fabric Manager / NVSwitch failure",
            "warning",
            "restart_app",
            "Fabric Manager failed: on an NVSwitch system (HGX/DGX) CUDA then fails with 'system not yet "
            "initialized' (802). Check `systemctl status nvidia-fabricmanager` and that its version equals the "
            "driver's; restart it (a GPU reset may be needed in between). On a system without NVSwitch it is not "
            "needed.",
            "NVIDIA Fabric Manager user guide",
        ),
        FaultInfo(
            "fabric_not_initialized",
            "CUDA: system not yet initialized (NVSwitch fabric)",
            "drain",
            "reboot_node",
            "CUDA cannot start on this node (802): the NVLink fabric is not up. Drain the node; start "
            "nvidia-fabricmanager with the driver's version (`systemctl status nvidia-fabricmanager`), reboot if "
            "the GPUs stay unregistered.",
            "CUDA runtime cudaErrorSystemNotReady (802); NVIDIA Fabric Manager user guide",
        ),
        FaultInfo(
            "ecc_uncorrectable",
            "Uncorrectable ECC error (seen by CUDA)",
            "reset",
            "reset_gpu",
            f"GPU memory hardware: {_ECC_RUN}. A pending row remap: reset the GPU (nvidia-smi -r -i <id>) and "
            "restart the job; a remap failure, or errors again after the reset: drain and RMA. The kernel log's "
            "Xid 48/94/95 names the GPU.",
            "CUDA runtime cudaErrorECCUncorrectable (214); NVIDIA A100/H100 memory error management",
        ),
        FaultInfo(
            "nvlink_uncorrectable",
            "Uncorrectable NVLink error (seen by CUDA)",
            "reset",
            "reset_gpu",
            "NVLink hardware: run `nvidia-smi nvlink -e` (error counters) and `nvidia-smi nvlink -s` on the node, "
            "look for Xid 74 / 144-150 and SXids in the kernel log; reset the GPU (nvidia-smi -r -i <id>); errors "
            "again on the same link: drain and check the link / NVSwitch.",
            "CUDA runtime cudaErrorNvlinkUncorrectable (220); NVIDIA Xid catalog WORKFLOW_NVLINK_ERR",
        ),
        FaultInfo(
            "gpu_lost",
            "GPU lost (seen by the application)",
            "drain",
            "reboot_node",
            "The GPU fell off the bus (treated as Xid 79): drain the node and reboot; check power, seating, cooling "
            "and SBIOS; RMA if it repeats.",
            "NVIDIA Xid catalog, Xid 79 (RESTART_BM)",
        ),
        FaultInfo(
            "reset_required",
            "GPU reset required (NV_ERR_RESET_REQUIRED)",
            "reset",
            "reset_gpu",
            "The driver needs a GPU reset before the GPU works again (CUDA reports 'busy or unavailable'): drain "
            "the GPU's work and reset it (nvidia-smi -r -i <id>); if the reset fails, reboot the node.",
            "NVIDIA driver status NV_ERR_RESET_REQUIRED; NVML recovery action GPU_RESET",
        ),
        FaultInfo(
            "driver_mismatch",
            "NVIDIA driver / library version mismatch",
            "drain",
            "reboot_node",
            "The loaded kernel module and the user-space NVIDIA libraries differ (driver upgraded without a "
            "reboot, or broken packages): no CUDA job can start. Drain; compare /proc/driver/nvidia/version with "
            "the packages, fix them and reboot.",
            "NVML NVML_ERROR_LIB_RM_VERSION_MISMATCH",
        ),
        FaultInfo(
            "host_fatal",
            "Fatal host hardware error (APEI/GHES)",
            "drain",
            "reboot_node",
            "The platform reported a fatal hardware error (host memory, PCIe root complex, CPU): drain the node "
            "and check the BMC / SEL record before it takes jobs again.",
            "Linux APEI GHES ([Hardware Error]: event severity: fatal)",
        ),
        FaultInfo(
            "gsp_timeout",
            "GSP firmware timeout (heartbeat / RPC), like Xid 119",
            "reset",
            "reset_gpu",
            "The GPU's System Processor (GSP) stopped answering the driver: stop the GPU's processes and reset it "
            "(nvidia-smi -r -i <index>) or reboot the node; NVML calls on it may hang until then. If it repeats, "
            "update the driver / firmware and collect nvidia-bug-report.sh for NVIDIA (Xid 119: RESET_GPU, then "
            "INVESTIGATE_SW).",
            "NVIDIA driver messages (NVRM: _kgspIsHeartbeatTimedOut, *** GSP Timeout ***); NVIDIA Xid catalog: "
            "Xid 119 GSP_RPC_TIMEOUT and 120 GSP_ERROR are RESET_GPU",
        ),
        FaultInfo(
            "memsys_error",
            "GPU memory subsystem error (GSP), like Xid 120",
            "reset",
            "reset_gpu",
            "The driver found a GPU memory-subsystem error (kgmmuCheckMemSubsysError): stop the GPU's processes and "
            "reset it (nvidia-smi -r -i <index>); then run `nvidia-smi -q -d ECC,ROW_REMAPPER`; errors again after "
            "the reset: drain and RMA.",
            "NVIDIA driver message (NVRM: kgmmuCheckMemSubsysError_IMPL: Memory Subsystem Error detected); NVIDIA "
            "Xid catalog: Xid 120 GSP_ERROR and 95 uncontained memory error are RESET_GPU",
        ),
        FaultInfo(
            "smi_err",
            "nvidia-smi cannot read the GPU (ERR!)",
            "reset",
            "reset_gpu",
            "nvidia-smi printed ERR! for several of the GPU's fields: the driver cannot read it. Look for Xids (79, "
            "119, 154) in the kernel log, stop the GPU's processes and reset it (nvidia-smi -r -i <index>); if the "
            "reset fails, reboot the node. One sensor alone (fan or power) is usually transient: no action.",
            "nvidia-smi table output (ERR!); Azure HPC diagnostics (a lone ERR! power reading is transient)",
        ),
        FaultInfo(
            "unknown_error",
            "CUDA unknown error",
            "reset",
            "reset_gpu",
            "CUDA 'unknown error' (999): the GPU or the driver is in a bad state. Check the kernel log for Xids; "
            "reset the GPU or reboot.",
            "CUDA runtime cudaErrorUnknown (999)",
        ),
    )
}


def fault(name: str) -> FaultInfo:
    """The catalog entry of a no-Xid fault; an unknown name needs review."""
    return FAULTS.get(name) or FaultInfo(name, name, "review", "contact_support", SEVERITY_ACTION["review"], "-")
