"""No function in the product code (amct_ext/, models/, tools/) is over 120 lines (the developer
guide's rule; issue 37). The count is benchmarks/long_functions.py's: def line (or its first
decorator) through the last line."""
from tests.conftest import REPO, load_script

LIMIT = 120


def test_the_counter_counts_a_known_function(tmp_path):
    lf = load_script("benchmarks/long_functions.py")
    (tmp_path / "amct_ext").mkdir()
    body = "\n".join(f"    x{i} = {i}" for i in range(129))
    (tmp_path / "amct_ext" / "m.py").write_text(f"import functools\n\n\n@functools.cache\ndef f():\n{body}\n")
    assert lf.function_lengths(tmp_path, ("amct_ext",)) == [(131, "amct_ext/m.py:5 f")]


def test_no_product_function_is_over_the_limit():
    lf = load_script("benchmarks/long_functions.py")
    lengths = lf.function_lengths(REPO)
    assert len(lengths) > 500
    over = [f"{where}: {n} lines" for n, where in lengths if n > LIMIT]
    assert over == [], "split these (benchmarks/long_functions.py lists them): " + "; ".join(over)
