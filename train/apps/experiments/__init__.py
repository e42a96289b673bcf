"""One-off experiments behind tables in the docs: EAGLE-3 layer styles at equal budget (compare_layer_styles.py) and
which training settings pay on a CPU budget (sweep.py)."""
