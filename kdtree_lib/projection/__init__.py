"""The CT200 projection: what DDTree on Kimi K2.6 should give on 8x RTX PRO 6000 Blackwell (PCIe), from
measured rows, each input checked against physics and printed with the row it came from.

One module per job:
  roofline     the cost model of a verify step and of the drafter (Hardware, Efficiency, KernelTime)
  physics      refusals: rows faster than their roofline, efficiencies above 1, bandwidths above the copy's
  calibration  efficiencies and kernel times fitted to measured rows
  rows         which rows of data/results/ are read (the newest runs of the kernels the box runs)
  inputs       the box's inputs, each measured (with its rows) or a labelled ASSUMPTION
  acceptance   acceptance sources and the depth structure read from depth rows (siblings' share of the gain)
  table        the projection table, its best budgets, band and headline
  stop         the latency-aware stop against the best fixed budget
Every public name is re-exported here, so `projection.X` reads the same whichever module owns X.
"""
from ..dflash import DRAFTER_PLACEMENTS  # noqa: F401  (projection.DRAFTER_PLACEMENTS, as before the split)
from .roofline import (CT200, HARDWARE_UNITS, Efficiency, Hardware, KernelTime, allreduce_time, assumptions,  # noqa: F401
                       drafter_costs, drafter_seconds, drafter_shards, expected_distinct_experts, layer_costs,
                       projected_speedup, real_drafter_config, step_costs)
from .physics import Refusal, Unphysical, check_efficiency, check_fraction, check_rows, row_label  # noqa: F401
from .calibration import (calibrate, calibrate_on_rows, drafter_efficiency, fit_kernel_time, fit_residuals,  # noqa: F401
                          calibration_fit, measured_hardware, rows_expert_bits)
from .rows import (BOX_MOE_PROVIDER, COMPONENTS, PORTABLE_VERIFY_CONFIGS, TREE_KERNEL_COLUMNS, box_build_rows,  # noqa: F401
                   box_topk_rows, draft_round_seconds, latest_rows, moe_layer_split, portable_verify_rows,
                   select_rows, touched_vs_uniform, whole_model_rows, COUNT_RESOLUTION, growth_lines, layer_spread,
                   uniform_sides, TimingRows, real_shape_rows, timing_rows)
from .inputs import (Input, KernelInputs, allreduce_inputs, assumed, box_efficiency, hardware_inputs,  # noqa: F401
                     kernel_fit, moe_kernel_inputs, row_seconds_by_batch, rows_source, tree_stage_cost,
                     verify_kernel_inputs)
from .acceptance import (SERVICE_OBSERVED, AcceptanceSource, DepthSource, DepthStructure, acceptance_curve,  # noqa: F401
                         depth_source, depth_structure, depth_structures, measured_acceptance, service_acceptance)
from .table import (EXTERNAL_REFERENCES, EXTERNAL_SOURCE, OVERLAPS, Reference, best_table, headline,  # noqa: F401
                    nearest_overlap, projection_table, reference_lines, references, round_rows, speedup_band,
                    takeaway_lines)
from .stop import latency_aware_budgets, round_seconds_of_nodes, stop_rule_comparison, tree_log_weights  # noqa: F401
