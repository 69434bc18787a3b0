"""What the evaluation's rows say: paired ratios with bootstrap intervals (`compare`), the per-cell
summary (`summary`), the report's markdown sections (`markdown`) and plots (`plots`)."""
