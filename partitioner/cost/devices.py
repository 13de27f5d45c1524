"""Hardware numbers for predicting costs on a GPU we are not running on.

Peak numbers are the vendors' dense (no sparsity) figures:

* A100 SXM4 80GB: NVIDIA A100 datasheet (2021): FP32 19.5 TFLOP/s, BF16/FP16
  tensor core 312 TFLOP/s, HBM2e 2,039 GB/s, NVLink 3 600 GB/s total (300 GB/s
  each way), 80 GB.
* A100 SXM4 40GB (``a100-40gb``): NVIDIA A100 datasheet (2021): compute as the 80 GB part,
  HBM2 1,555 GB/s, 40 GB; MosaicML's benchmark nodes (llm-foundry
  ``scripts/train/benchmarking/README.md``: "1600 Gbps node-node interconnect (RoCE)" per
  8-GPU node) give 200 Gb/s = 25 GB/s per GPU between nodes, as DGX A100's HDR.
* ``a100-opa``: the A100 SXM4 80GB nodes of Jean Zay that BLOOM trained on (BigScience
  ``train/tr11-176B-ml/README.md``: 8 GPUs per node, NVLink, "4 OmniPath links" per node):
  Intel Omni-Path 100 Series links are 100 Gb/s each, so 4 x 100 Gb/s per 8 GPUs is
  50 Gb/s = 6.25 GB/s per GPU between nodes.
* H100 SXM5 80GB: NVIDIA H100 datasheet (2023): FP32 67 TFLOP/s, BF16/FP16
  989 TFLOP/s, HBM3 3.35 TB/s, NVLink 4 900 GB/s total (450 GB/s each way).
* H200 SXM 141GB: NVIDIA H200 datasheet (2024): compute as H100, HBM3e
  4.8 TB/s, 141 GB, NVLink 900 GB/s total.
* ``h100-500w``: the H100 of Meta's Grand Teton hosts that torchtitan's published
  benchmarks ran on (torchtitan ``benchmarks/llama3_h100_202412_torchtitan.md``,
  "Hardware"): 96 GB HBM2e at 2.4 TB/s, NVLink within 8-GPU hosts, 400 Gb/s RDMA per
  GPU, held at the default 500 W power limit.  Its peak is "between SXM and NVL, and we
  don't know its exact value" (same file, footnote 2): the H100 NVL datasheet gives
  835 dense BF16 TFLOP/s against the SXM's 989, so :data:`H100_500W_PEAK_SHARE` (the
  share of the SXM peak) lies in [0.844, 1]; fitted to torchtitan's runs, it is 835.

The accelerators of 2026 (issue 33), per GPU, dense figures (the vendors print the
sparse ones, twice these, in their headline tables):

* B200 (``b200``, HGX/DGX B200): NVIDIA's per-GPU table on the GB200 NVL72 page
  (nvidia.com/en-us/data-center/gb200-nvl72, "HGX B200" column): FP32 75 TFLOP/s,
  FP16/BF16 tensor core 4.5 PFLOP/s with sparsity (2.25 dense), 180 GB HBM3e at
  7.7 TB/s; NVLink 5 1.8 TB/s total (900 GB/s each way).  One ConnectX-7 400 Gb/s port
  per GPU, as DGX H100 (NVIDIA's HGX table: 0.8 TB/s of networking for 8 GPUs, both ways;
  MLCommons inference v6.0, Nebius' ``nebius_b200_n1``: "8x ConnectX-7 IB NDR 400Gb/s"),
  50 GB/s per GPU.
* GB200 (``gb200``, the GPU of GB200 NVL72): the same page's "GB200 NVL72" column:
  FP32 80 TFLOP/s, FP16/BF16 5 PFLOP/s with sparsity (2.5 dense), 186 GB HBM3e at
  8 TB/s, NVLink 5 1.8 TB/s (130 TB/s over 72 GPUs).  Each compute tray of 4 GPUs has
  4 ConnectX-7 adapters (MLCommons inference v6.1, Crusoe's ``GB200-NVL72`` system
  description: "for each 4-GPU node: 4x ... BlueField-3 [ConnectX-7 Lx]"), 400 Gb/s =
  50 GB/s per GPU; the 800 Gb/s ConnectX-8 came with GB300 (NVIDIA's GB300 NVL72 reference
  architecture: 4 per tray), not GB200.  The 72-GPU NVLink domain is not
  modelled as such: plan with ``--gpus-per-node`` up to 72 for it (a node is NVLink).
* B300 (``b300``, HGX/DGX B300, Blackwell Ultra): NVIDIA's per-GPU table on the GB300
  NVL72 page ("HGX B300" column): FP32 75 TFLOP/s, FP16/BF16 4.5 PFLOP/s with sparsity
  (2.25 dense, as B200: Blackwell Ultra adds FP4 and attention throughput, not BF16),
  270 GB HBM3e at 7.7 TB/s (DGX B300's 2.3 TB for 8 is the stacks' 288 GB each; the
  per-GPU table's smaller figure is taken, as B200's 180 GB), NVLink 5 900 GB/s each way; one ConnectX-8 800 Gb/s SuperNIC per
  GPU (HGX B300: 1.6 TB/s of networking for 8 GPUs, both ways), 100 GB/s.
* MI300X (``mi300x``): AMD Instinct MI300X data sheet: peak FP32 vector 163.4
  TFLOP/s, BF16/FP16 matrix 1,307.4 TFLOP/s dense (2,614.9 with sparsity), 192 GB
  HBM3 at 5.3 TB/s; 7 Infinity Fabric links of 128 GB/s (64 GB/s each way), one to each
  other GPU of the 8-GPU OAM platform, so 448 GB/s each way per GPU spread over its 7
  peers: a ring collective across the node's GPUs uses all of them (RCCL lays rings over
  every link), one point-to-point pipeline message only one (64 GB/s), which this
  per-GPU figure makes optimistic.  Between nodes 400 Gb/s per GPU, 50 GB/s: Azure's
  ND MI300X v5 (8 MI300X, "InfiniBand: ... 8x400 Gigabit NDR"; Microsoft's
  ``nd-mi300x-v5-series`` size page).
* MI325X (``mi325x``): AMD Instinct MI325X data sheet: compute and Infinity Fabric as
  MI300X (the same CDNA 3 die), 256 GB HBM3E at 6 TB/s.
* MI355X (``mi355x``): AMD Instinct MI355X data sheet: peak FP32 vector 157.3 TFLOP/s,
  BF16/FP16 matrix 2.5 PFLOP/s dense (5.0 with sparsity), 288 GB HBM3E at 8 TB/s;
  7 Infinity Fabric links of 153.6 GB/s (76.8 GB/s each way), 537.6 GB/s each way per
  GPU with MI300X's caveat; between nodes 400 Gb/s per GPU as MI300X's platforms (AMD
  pairs each MI355X with a 400 Gb/s Pensando Pollara 400 NIC), 50 GB/s.
* L40S (``l40s``): NVIDIA L40S datasheet: FP32 91.6 TFLOP/s, BF16/FP16 tensor core
  362.05 TFLOP/s dense (733 with sparsity), 48 GB GDDR6 at 864 GB/s, no NVLink: PCIe
  Gen4 x16, 64 GB/s both ways, 32 GB/s each way between GPUs of a node.  Between nodes
  NVIDIA's Enterprise Reference Architecture for PCIe servers ("2-8-5": 2 CPUs, 8 GPUs,
  4 east-west 400 Gb/s adapters and 1 north-south) gives a 400 Gb/s port per 2 GPUs,
  25 GB/s per GPU.

Blackwell (``b200``, ``gb200``, ``b300``) is calibrated by published FP8 runs
(:data:`BLACKWELL_EFFICIENCY`, fitted to :data:`BLACKWELL_RUNS`, Megatron-Bridge's dense Llama 3
FP8 rows on DGX-B200 and DGX-GB200; B300 has no run and takes its generation's shares).  Its
only dense published runs are FP8, so one ``matmul`` share prices bf16 and FP8 matmuls alike
(bf16 matmuls on Blackwell are not checked by any dense run).  The others (AMD Instinct, L40S)
are not calibrated: no published run in ``tools/published`` ran on them, so they carry no
efficiencies (the bare roofline, every op at its datasheet peak, which is optimistic: compare
H100's fitted 0.54 of the peak for matmuls) and every report says so.  Hopper's or Ampere's
shares are not copied onto them: another die, other kernels.

FP8 (``--precision fp8``; dense ``float8_e4m3fn`` tensor-core peaks, in ``peak_flops``): H100 SXM,
H200 and H800 1,979 TFLOP/s (the datasheets' 3,958 are with sparsity; the 500 W H100 at its
share); B200 and B300 4.5 PFLOP/s and GB200 5 PFLOP/s (the GB200/GB300 NVL72 pages' per-GPU FP8
9 and 10 PFLOP/s are with sparsity), their block-scaled MXFP8 at the same peak (``peak_flops``
key ``mxfp8``: only Blackwell has it); MI300X and MI325X 2,614.9 TFLOP/s, MI355X 5 PFLOP/s
(AMD's data sheets: 5,229.8 and 10.1 PFLOP/s with sparsity); L40S 733 TFLOP/s (1,466 with
sparsity).  A100 (Ampere) has no FP8 tensor cores: no peak, and ``--precision fp8`` is refused
there.  FP8 matmuls are priced with the device's ``fp8-matmul`` efficiency where it gives one,
else its ``matmul`` one (:meth:`DeviceSpec.efficiency_of`): Hopper's bf16 share, which lands
Megatron-Bridge's three H100 FP8 runs within 15% held out (docs/accuracy.md, FP8), and
Blackwell's, fitted to FP8 runs.

FP32 uses the non-tensor-core peak because PyTorch leaves TF32 matmuls off by
default (``torch.backends.cuda.matmul.allow_tf32 = False``).  BF16 (and FP16) is
the dense tensor-core peak: A100 312, H100 SXM 989, H200 989 TFLOP/s (the
datasheets' 624 / 1,979 are with 2:4 structured sparsity, which training does
not use).

Between nodes each GPU has its own network port, as in NVIDIA's reference
nodes: DGX H100 and DGX H200 have eight single-port ConnectX-7 InfiniBand NDR
adapters, 400 Gb/s = 50 GB/s per GPU each way (NVIDIA DGX H100/H200 User Guide,
hardware overview); DGX A100 has eight ConnectX-6 InfiniBand HDR adapters,
200 Gb/s = 25 GB/s per GPU (NVIDIA DGX A100 User Guide).  A message between
nodes is assumed to pay 15 µs against 10 µs inside a node: NCCL's own tuning
model charges a network ring step 9.6 µs against 3.4 µs over NVLink for its
Simple protocol (``hwLat`` in NCCL's ``src/graph/tuning.cc``), about 6 µs
more, which we add to our intra-node assumption.

``cpu`` describes this kind of machine for planning CPU-rank runs (gloo over
loopback); its numbers are rough measurements, not a datasheet, and its
"nodes" talk over the same link.

What the kernels reach of those peaks (``DeviceSpec.efficiency``, per op class of
:func:`partitioner.cost.nodecost.op_class`) is fitted per GPU generation to published
bf16/fp16 training runs by ``tools/validate_published.py --fit`` (docs/accuracy.md):
:data:`H100_EFFICIENCY` for every Hopper GPU here (the same die and the same cuBLAS /
FlashAttention kernels; H200 and the 500 W H100 differ in memory and power, priced by their
own bandwidth and peak), :data:`A100_EFFICIENCY` for every Ampere one,
:data:`BLACKWELL_EFFICIENCY` for every Blackwell one (fitted to FP8 runs).  A device's
``calibrated_by`` names the runs fitted; a device no run calibrates (a user's file without
them) says so in every report.

Example::

    >>> h100 = device_spec("h100")
    >>> h100.peak("bfloat16") / 1e12, h100.inter_node_bandwidth, h100.inter_node_latency
    (989.0, 50000000000.0, 1.5e-05)
    >>> device_spec("cpu").inter_node_bandwidth is None  # the intra-node link's
    True
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any

from partitioner.units import GIB

try:  # Python 3.11+; on 3.10 a device file is JSON
    import tomllib
except ModuleNotFoundError:  # pragma: no cover - Python 3.10
    tomllib = None  # type: ignore[assignment]

__all__ = ["A100_EFFICIENCY", "AMPERE_RUNS", "BLACKWELL_EFFICIENCY", "BLACKWELL_RUNS", "DEVICES", "GIB", "H100_500W_PEAK_SHARE", "H100_EFFICIENCY", "HOPPER_RUNS",
           "DeviceSpec", "device_spec", "load_device"]

# Share of the datasheet peak each op class reaches (partitioner.cost.nodecost.op_class), per GPU generation:
# fitted by ``tools/validate_published.py --fit`` (least worst |log error|) to that generation's published runs
# marked "fit" (HOPPER_RUNS, AMPERE_RUNS: at most a third of the runs; every other run is held out and priced
# by the same tool); memory-bound ops at the datasheet bandwidth (no run tells that share apart).
HOPPER_RUNS = ("mosaicml-70b-2048-512-h100", "mosaicml-7b-2048-8-h100", "8b-8-torchtitan", "70b-256-torchtitan",
               "405b-8k-llama3")
H100_EFFICIENCY: tuple[tuple[str, float], ...] = (("matmul", 0.538), ("attention", 0.74), ("memory", 1.0))
AMPERE_RUNS = ("megatron2021-t1-1.7b", "megatron2021-t1-18b", "megatron2021-t1-145b", "megatron2021-t1-1t",
               "megatron2021-t2-zero3-175b-384", "megatron2021-t2-ptdp-175b-768", "korthikanti2022-22b-selective",
               "korthikanti2022-175b-full", "korthikanti2022-530b-selective", "megascale2024-175b-256",
               "bloom-176b-training", "bloom-181b-tp8-pp6-m4", "mosaicml-70b-2048-64-a100",
               "mosaicml-7b-2048-8-a100", "mosaicml-13b-2048-64-a100-40gb")
A100_EFFICIENCY: tuple[tuple[str, float], ...] = (("matmul", 0.647), ("attention", 0.543), ("memory", 1.0))
# Blackwell: fitted to 3 of its 12 priced runs (Megatron-Bridge's dense Llama 3 FP8 rows; the other 7 dense FP8
# rows and the 2 bf16 GPT OSS rows held out), all FP8: one matmul share for FP8 and bf16 matmuls alike.
BLACKWELL_RUNS = ("8b-8-bridge-gb200-fp8cs", "70b-64-bridge-gb200-mxfp8", "405b-128-bridge-b200-fp8cs")
BLACKWELL_EFFICIENCY: tuple[tuple[str, float], ...] = (("matmul", 0.533), ("attention", 0.933), ("memory", 1.0))
# The 500 W Grand Teton H100's tensor-core peak over the SXM datasheet's, in [835 / 989, 1] (see above):
# the fit runs into the lower end, the H100 NVL's 835 TFLOP/s, so that is what it is.
H100_500W_PEAK_SHARE = 835e12 / 989e12


@dataclasses.dataclass(frozen=True)
class DeviceSpec:
    """One accelerator, the link between accelerators of one node and the link between nodes.

    ``inter_node_bandwidth`` / ``inter_node_latency`` of ``None`` (the default)
    mean the intra-node link's numbers: one kind of link everywhere.  Read both
    links through :func:`partitioner.cost.comm.link`, which resolves that.
    """

    name: str
    peak_flops: dict[str, float]  # dtype name -> FLOP/s
    memory_bandwidth: float  # bytes/s
    memory_bytes: int
    link_bandwidth: float  # bytes/s, one direction, point to point
    link_latency: float  # seconds per message
    kernel_overhead: float  # seconds per launched op (launch + sync), an assumption
    message_host_s: float = 0.0  # seconds of a rank's own time per message it sends or receives
    inter_node_bandwidth: float | None = None  # bytes/s per GPU, one direction; None: link_bandwidth
    inter_node_latency: float | None = None  # seconds per message between nodes; None: link_latency
    # Share of the peak each op class reaches in practice (1.0: the bare roofline); see
    # :func:`partitioner.cost.nodecost.op_class` for the classes and ``PUBLISHED_EFFICIENCY`` for values.
    efficiency: tuple[tuple[str, float], ...] = ()
    # The published runs those efficiencies were fitted to (tools/validate_published.py); () : none calibrates it.
    calibrated_by: tuple[str, ...] = ()

    def peak(self, dtype: str) -> float:
        return self.peak_flops.get(dtype, self.peak_flops["float32"])

    def efficiency_of(self, op_class: str) -> float:
        """The share of the peak (FLOPs or bandwidth) an op of ``op_class`` reaches; 1.0 unless calibrated.

        ``fp8-matmul`` falls back to ``matmul`` where the device gives no share of its own.

        >>> spec = dataclasses.replace(DEVICES["cpu"], efficiency=(("matmul", 0.5),))
        >>> spec.efficiency_of("fp8-matmul"), spec.efficiency_of("attention")
        (0.5, 1.0)
        """
        shares = dict(self.efficiency)
        if op_class == "fp8-matmul" and op_class not in shares:
            op_class = "matmul"
        return shares.get(op_class, 1.0)


def _gpu(
    name: str, fp32: float, half: float, hbm: float, mem_gb: float, link: float, network: float,
    efficiency: tuple[tuple[str, float], ...] = (), calibrated_by: tuple[str, ...] = (), *,
    fp8: float | None = None, mxfp8: bool = False,
) -> DeviceSpec:
    peaks = {"float32": fp32, "bfloat16": half, "float16": half}
    if fp8 is not None:  # FP8 tensor cores (dense); MXFP8: Blackwell's block-scaled ones, at the same peak
        peaks |= {"float8_e4m3fn": fp8, **({"mxfp8": fp8} if mxfp8 else {})}
    return DeviceSpec(
        name=name,
        peak_flops=peaks,
        memory_bandwidth=hbm,
        memory_bytes=int(mem_gb * 1e9),
        link_bandwidth=link,
        link_latency=10e-6,
        kernel_overhead=5e-6,
        inter_node_bandwidth=network,
        inter_node_latency=15e-6,
        efficiency=efficiency,
        calibrated_by=calibrated_by,
    )


DEVICES: dict[str, DeviceSpec] = {
    "a100": _gpu("a100", 19.5e12, 312e12, 2.039e12, 80, 300e9, 25e9, A100_EFFICIENCY, AMPERE_RUNS),  # HDR 200 Gb/s
    "a100-40gb": _gpu("a100-40gb", 19.5e12, 312e12, 1.555e12, 40, 300e9, 25e9, A100_EFFICIENCY,
                      AMPERE_RUNS),  # RoCE 1600 Gb/s per node
    "a100-opa": _gpu("a100-opa", 19.5e12, 312e12, 2.039e12, 80, 300e9, 6.25e9, A100_EFFICIENCY,
                     AMPERE_RUNS),  # 4 x 100 Gb/s OPA per node
    "h100": _gpu("h100", 67e12, 989e12, 3.35e12, 80, 450e9, 50e9, H100_EFFICIENCY, HOPPER_RUNS, fp8=1979e12),  # NDR 400 Gb/s
    "h100-500w": _gpu("h100-500w", 67e12 * H100_500W_PEAK_SHARE, 989e12 * H100_500W_PEAK_SHARE, 2.4e12, 96,
                      450e9, 50e9, H100_EFFICIENCY, HOPPER_RUNS, fp8=1979e12 * H100_500W_PEAK_SHARE),
    "h200": _gpu("h200", 67e12, 989e12, 4.8e12, 141, 450e9, 50e9, H100_EFFICIENCY, HOPPER_RUNS, fp8=1979e12),
    # H100 SXM compute and memory with NVLink cut to 400 GB/s both ways (DeepSeek-V3's cluster, arXiv:2412.19437
    # section 3.1: 8 per node, NVLink within, 400 Gb/s InfiniBand per GPU); Hopper's fitted efficiencies.
    "h800": _gpu("h800", 67e12, 989e12, 3.35e12, 80, 200e9, 50e9, H100_EFFICIENCY, HOPPER_RUNS, fp8=1979e12),
    # Blackwell: fitted to published FP8 runs (BLACKWELL_RUNS); B300 takes its generation's shares.
    "b200": _gpu("b200", 75e12, 2.25e15, 7.7e12, 180, 900e9, 50e9, BLACKWELL_EFFICIENCY, BLACKWELL_RUNS, fp8=4.5e15,
                 mxfp8=True),  # NVLink 5, ConnectX-7 400 Gb/s
    "gb200": _gpu("gb200", 80e12, 2.5e15, 8e12, 186, 900e9, 50e9, BLACKWELL_EFFICIENCY, BLACKWELL_RUNS, fp8=5e15,
                  mxfp8=True),  # NVL72's GPU, ConnectX-7 400 Gb/s
    "b300": _gpu("b300", 75e12, 2.25e15, 7.7e12, 270, 900e9, 100e9, BLACKWELL_EFFICIENCY, BLACKWELL_RUNS, fp8=4.5e15,
                 mxfp8=True),  # ConnectX-8 800 Gb/s
    # Uncalibrated (no published run): the bare datasheet roofline, efficiency=() and calibrated_by=().
    "mi300x": _gpu("mi300x", 163.4e12, 1307.4e12, 5.3e12, 192, 448e9, 50e9, fp8=2614.9e12),  # 7 x 64 GB/s Infinity Fabric
    "mi325x": _gpu("mi325x", 163.4e12, 1307.4e12, 6e12, 256, 448e9, 50e9, fp8=2614.9e12),
    "mi355x": _gpu("mi355x", 157.3e12, 2.5e15, 8e12, 288, 537.6e9, 50e9, fp8=5e15),  # 7 x 76.8 GB/s Infinity Fabric
    "l40s": _gpu("l40s", 91.6e12, 362.05e12, 0.864e12, 48, 32e9, 25e9, fp8=733e12),  # PCIe Gen4 x16, no NVLink
    # CPU ranks talking over gloo/loopback on this 2-core machine.
    "cpu": DeviceSpec(
        name="cpu",
        peak_flops={"float32": 50e9},
        memory_bandwidth=10e9,
        memory_bytes=16 * GIB,
        link_bandwidth=1.0e9,
        # One-way, while both cores compute (as pipelined ranks do): ~460 us for 96 KB, 140 us idle;
        # each message also takes ~0.1 ms of the rank's own time (gloo's copies and wake-ups).
        link_latency=400e-6,
        kernel_overhead=10e-6,
        message_host_s=100e-6,
    ),
}


def device_spec(name: str) -> DeviceSpec:
    """A device by name (a key of :data:`DEVICES`: ``a100``, ``h100``, ``h200``, ``b200``, ``mi300x``, ``l40s``,
    ``cpu``, ...), or read from a JSON/TOML file.

    A name ending in ``.json`` or ``.toml`` (or naming a file) is a user's own
    device: :func:`load_device`.
    """
    from partitioner.errors import AutopartitionError

    key = name.lower()
    if key in DEVICES:
        return DEVICES[key]
    if key.endswith((".json", ".toml")) or os.path.isfile(name):
        return load_device(name)
    raise AutopartitionError(
        f"Unknown device {name!r}. Choose one of {', '.join(sorted(DEVICES))}, 'auto' to measure on this "
        "machine, or a JSON or TOML file describing your own (DeviceSpec's fields: see docs/devices.md)."
    )


# A device file's fields: DeviceSpec's, each required but those with a default here.
_FILE_DEFAULTS: dict[str, Any] = {"kernel_overhead": 5e-6, "message_host_s": 0.0, "calibrated_by": ()}


def load_device(path: str | os.PathLike[str]) -> DeviceSpec:
    """A :class:`DeviceSpec` from a JSON or TOML file of its fields; a missing, unknown or ill-typed one refused by name.

    Numbers in SI units: FLOP/s, bytes, bytes/s (one direction), seconds.  ``peak_flops``
    maps dtypes (``float32``, ``bfloat16``, ...) to FLOP/s and must give ``float32``;
    ``efficiency`` maps op classes (``matmul``, ``attention``, ``memory``) to the share
    of the peak reached (0 .. 1]; ``calibrated_by`` optionally names the runs that fitted
    them.  ``inter_node_bandwidth`` is one GPU's network port.

    >>> import json, tempfile
    >>> fields = {"name": "mine", "peak_flops": {"float32": 19.5e12, "bfloat16": 312e12}, "memory_bytes": 40e9,
    ...           "memory_bandwidth": 1.555e12, "link_bandwidth": 300e9, "link_latency": 1e-5,
    ...           "inter_node_bandwidth": 25e9, "inter_node_latency": 1.5e-5, "efficiency": {"matmul": 0.6}}
    >>> with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
    ...     _ = f.write(json.dumps(fields))
    >>> spec = load_device(f.name)
    >>> spec.name, spec.memory_bytes, spec.efficiency_of("matmul"), spec.efficiency_of("attention")
    ('mine', 40000000000, 0.6, 1.0)
    >>> os.unlink(f.name)
    """
    from partitioner.errors import AutopartitionError

    file = Path(path)
    what = f"device file {file}"
    if not file.is_file():
        raise AutopartitionError(f"No {what}: give --device a name ({', '.join(sorted(DEVICES))}) or an existing "
                                 "JSON or TOML file.")
    text = file.read_text()
    toml = file.suffix.lower() == ".toml"
    if toml and tomllib is None:
        raise AutopartitionError(f"The {what} is TOML, which needs Python 3.11; write it as JSON instead.")
    try:
        data = tomllib.loads(text) if toml else json.loads(text)
    except ValueError as exc:  # tomllib.TOMLDecodeError is a ValueError
        raise AutopartitionError(f"The {what} is not valid {'TOML' if file.suffix == '.toml' else 'JSON'}: {exc}.")
    if not isinstance(data, dict):
        raise AutopartitionError(f"The {what} should hold one table of DeviceSpec's fields.")
    fields = {f.name for f in dataclasses.fields(DeviceSpec)}
    unknown = sorted(set(data) - fields)
    missing = sorted(fields - set(data) - set(_FILE_DEFAULTS))
    if unknown or missing:
        parts = ([f"unknown fields {unknown} (DeviceSpec has {sorted(fields)})"] if unknown else []) + \
                ([f"missing fields {missing}"] if missing else [])
        raise AutopartitionError(f"The {what} has {' and '.join(parts)}.")
    values = {**_FILE_DEFAULTS, **data}

    def number(key: str, *, positive: bool = True) -> float:
        value = values[key]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or value < 0 or (positive and value == 0):
            raise AutopartitionError(f"The {what}: {key} is {value!r}, expected a {'positive ' if positive else ''}"
                                     "number (SI units).")
        return float(value)

    def table(key: str, *, share: bool) -> dict[str, float]:
        value = values[key]
        if not isinstance(value, dict) or not all(isinstance(k, str) for k in value):
            raise AutopartitionError(f"The {what}: {key} should be a table of names to numbers, got {value!r}.")
        out: dict[str, float] = {}
        for k, v in value.items():
            if isinstance(v, bool) or not isinstance(v, (int, float)) or v <= 0 or (share and v > 1):
                raise AutopartitionError(f"The {what}: {key}.{k} is {v!r}, expected "
                                         f"{'a share in (0, 1]' if share else 'a positive number'}.")
            out[k] = float(v)
        return out

    peaks = table("peak_flops", share=False)
    if "float32" not in peaks:
        raise AutopartitionError(f"The {what}: peak_flops must give float32 (the peak any other dtype falls back to).")
    name = values["name"]
    runs = values["calibrated_by"]
    if not isinstance(name, str) or not name or not isinstance(runs, (list, tuple)) \
            or not all(isinstance(r, str) for r in runs):
        raise AutopartitionError(f"The {what}: name should be a non-empty string and calibrated_by a list of "
                                 "strings.")
    return DeviceSpec(
        name=name, peak_flops=peaks, memory_bandwidth=number("memory_bandwidth"),
        memory_bytes=int(number("memory_bytes")), link_bandwidth=number("link_bandwidth"),
        link_latency=number("link_latency", positive=False), kernel_overhead=number("kernel_overhead", positive=False),
        message_host_s=number("message_host_s", positive=False),
        inter_node_bandwidth=number("inter_node_bandwidth"),
        inter_node_latency=number("inter_node_latency", positive=False),
        efficiency=tuple(sorted(table("efficiency", share=True).items())),
        calibrated_by=tuple(runs),
    )
