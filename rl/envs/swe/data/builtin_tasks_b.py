"""Built-in SWE tasks 9-16 (rl/envs/swe/data/builtin_tasks.py explains the format and joins them
in order; split from it by size: task data, one task after another)."""
from __future__ import annotations

from rl.envs.swe.data.task_source import T

TASKS = [
    T("fahrenheit-precedence", """
        fahrenheit_to_celsius gives absurd values

        `fahrenheit_to_celsius(212)` returns `194.2` instead of `100.0`. Looks like an operator precedence
        problem. celsius_to_fahrenheit is fine.
        """,
      {"units/__init__.py": "",
       "units/temperature.py": """
        def celsius_to_fahrenheit(c):
            return c * 9 / 5 + 32


        def fahrenheit_to_celsius(f):
            return f - 32 * 5 / 9
        """,
       "tests/test_temperature.py": """
        from units.temperature import celsius_to_fahrenheit


        def test_c_to_f():
            assert celsius_to_fahrenheit(100) == 212
        """},
      [("units/temperature.py", "    return f - 32 * 5 / 9", "    return (f - 32) * 5 / 9")],
      {"tests/test_temperature_issue.py": """
        import pytest
        from units.temperature import celsius_to_fahrenheit, fahrenheit_to_celsius


        def test_boiling():
            assert fahrenheit_to_celsius(212) == pytest.approx(100)


        def test_round_trip():
            assert fahrenheit_to_celsius(celsius_to_fahrenheit(37)) == pytest.approx(37)


        def test_minus_forty():
            assert celsius_to_fahrenheit(-40) == -40
        """}),

    T("word-frequencies-normalize", """
        word_frequencies counts "The" and "the," as different words

        Counting should be case-insensitive and ignore surrounding punctuation:
        `word_frequencies("The cat. the CAT!")` should be `{"the": 2, "cat": 2}`.
        """,
      {"wordcount.py": """
        from collections import Counter


        def word_frequencies(text):
            return dict(Counter(text.split()))


        def top_words(text, n):
            freq = word_frequencies(text)
            return sorted(freq, key=lambda w: (-freq[w], w))[:n]
        """,
       "tests/test_wordcount.py": """
        from wordcount import word_frequencies


        def test_simple():
            assert word_frequencies("a b a") == {"a": 2, "b": 1}
        """},
      [("wordcount.py", "    return dict(Counter(text.split()))",
        """
            words = (w.strip(".,;:!?\\"'()[]").lower() for w in text.split())
            return dict(Counter(w for w in words if w))
        """)],
      {"tests/test_wordcount_issue.py": """
        from wordcount import top_words, word_frequencies


        def test_case_and_punctuation():
            assert word_frequencies("The cat. the CAT!") == {"the": 2, "cat": 2}


        def test_trailing_punctuation():
            assert word_frequencies("Hi... hi") == {"hi": 2}


        def test_top_words():
            assert top_words("b a B c a b", 2) == ["b", "a"]
        """}),

    T("inventory-negative-stock", """
        Inventory.remove lets stock go negative

        Removing more units than are in stock silently makes the count negative. It should raise
        `OutOfStockError` (from `shop.errors`) and leave the stock unchanged. Removing a non-positive
        quantity should raise `ValueError`.
        """,
      {"shop/__init__.py": "",
       "shop/errors.py": """
        class ShopError(Exception):
            pass


        class OutOfStockError(ShopError):
            pass
        """,
       "shop/inventory.py": """
        class Inventory:
            def __init__(self):
                self._stock = {}

            def add(self, sku, qty):
                if qty <= 0:
                    raise ValueError("quantity must be positive")
                self._stock[sku] = self._stock.get(sku, 0) + qty

            def remove(self, sku, qty):
                self._stock[sku] = self._stock.get(sku, 0) - qty

            def count(self, sku):
                return self._stock.get(sku, 0)
        """,
       "tests/test_inventory.py": """
        from shop.inventory import Inventory


        def test_add_remove():
            inv = Inventory()
            inv.add("x", 5)
            inv.remove("x", 2)
            assert inv.count("x") == 3
        """},
      [("shop/inventory.py", "class Inventory:",
        "from shop.errors import OutOfStockError\n\n\nclass Inventory:"),
       ("shop/inventory.py", "        self._stock[sku] = self._stock.get(sku, 0) - qty",
        """
                if qty <= 0:
                    raise ValueError("quantity must be positive")
                have = self._stock.get(sku, 0)
                if qty > have:
                    raise OutOfStockError(f"{sku}: {have} in stock, {qty} requested")
                self._stock[sku] = have - qty
        """)],
      {"tests/test_inventory_issue.py": """
        import pytest
        from shop.errors import OutOfStockError
        from shop.inventory import Inventory


        def test_over_remove():
            inv = Inventory()
            inv.add("x", 1)
            with pytest.raises(OutOfStockError):
                inv.remove("x", 2)
            assert inv.count("x") == 1


        def test_unknown_sku():
            with pytest.raises(OutOfStockError):
                Inventory().remove("nope", 1)


        def test_non_positive():
            inv = Inventory()
            inv.add("x", 1)
            with pytest.raises(ValueError):
                inv.remove("x", 0)
        """}),

    T("leap-year-century", """
        is_leap_year(1900) returns True

        Century years are leap years only when divisible by 400: 1900 is not a leap year, 2000 is.
        This also makes days_in_month(1900, 2) return 29.
        """,
      {"calendar_utils.py": """
        _DAYS = [31, 28, 31, 30, 31, 30, 31, 31, 30, 31, 30, 31]


        def is_leap_year(year):
            return year % 4 == 0


        def days_in_month(year, month):
            if month == 2 and is_leap_year(year):
                return 29
            return _DAYS[month - 1]
        """,
       "tests/test_calendar_utils.py": """
        from calendar_utils import days_in_month, is_leap_year


        def test_leap():
            assert is_leap_year(2024) and not is_leap_year(2023)


        def test_days():
            assert days_in_month(2023, 1) == 31
        """},
      [("calendar_utils.py", "    return year % 4 == 0",
        "    return year % 4 == 0 and (year % 100 != 0 or year % 400 == 0)")],
      {"tests/test_calendar_issue.py": """
        from calendar_utils import days_in_month, is_leap_year


        def test_centuries():
            assert not is_leap_year(1900) and is_leap_year(2000)


        def test_february_1900():
            assert days_in_month(1900, 2) == 28


        def test_february_2024():
            assert days_in_month(2024, 2) == 29
        """}),

    T("chunk-partial-tail", """
        chunk() drops the last partial chunk

        `chunk([1, 2, 3, 4, 5], 2)` returns `[[1, 2], [3, 4]]`; the trailing `[5]` is lost. It should be
        kept. `chunk(x, 0)` should raise ValueError instead of looping forever / failing obscurely.
        """,
      {"seqtools.py": """
        def chunk(seq, size):
            seq = list(seq)
            return [seq[i:i + size] for i in range(0, len(seq) - size + 1, size)]


        def pairwise(seq):
            seq = list(seq)
            return list(zip(seq, seq[1:]))
        """,
       "tests/test_seqtools.py": """
        from seqtools import chunk, pairwise


        def test_even_chunks():
            assert chunk([1, 2, 3, 4], 2) == [[1, 2], [3, 4]]


        def test_pairwise():
            assert pairwise("abc") == [("a", "b"), ("b", "c")]
        """},
      [("seqtools.py",
        "    seq = list(seq)\n    return [seq[i:i + size] for i in range(0, len(seq) - size + 1, size)]",
        """
            if size < 1:
                raise ValueError("size must be >= 1")
            seq = list(seq)
            return [seq[i:i + size] for i in range(0, len(seq), size)]
        """)],
      {"tests/test_seqtools_issue.py": """
        import pytest
        from seqtools import chunk


        def test_tail_kept():
            assert chunk([1, 2, 3, 4, 5], 2) == [[1, 2], [3, 4], [5]]


        def test_short():
            assert chunk("ab", 5) == [["a", "b"]]


        def test_zero():
            with pytest.raises(ValueError):
                chunk([1], 0)


        def test_empty():
            assert chunk([], 3) == []
        """}),

    T("tags-mutable-default", """
        add_tag remembers tags from earlier calls

        `add_tag("a")` returns `["a"]`, then a separate `add_tag("b")` returns `["a", "b"]`. Each call
        without an explicit list should start from an empty list.
        """,
      {"tagging.py": """
        def add_tag(tag, tags=[]):
            if tag not in tags:
                tags.append(tag)
            return tags


        def normalize(tag):
            return tag.strip().lower()
        """,
       "tests/test_tagging.py": """
        from tagging import add_tag, normalize


        def test_explicit_list():
            assert add_tag("x", ["y"]) == ["y", "x"]


        def test_normalize():
            assert normalize("  Foo ") == "foo"
        """},
      [("tagging.py", "def add_tag(tag, tags=[]):\n    if tag not in tags:",
        "def add_tag(tag, tags=None):\n    tags = [] if tags is None else tags\n    if tag not in tags:")],
      {"tests/test_tagging_issue.py": """
        from tagging import add_tag


        def test_independent_calls():
            assert add_tag("a") == ["a"]
            assert add_tag("b") == ["b"]


        def test_no_duplicates():
            assert add_tag("a", ["a"]) == ["a"]
        """}),

    T("binary-search-last", """
        binary_search misses the last element

        `binary_search([1, 3, 5, 7], 7)` returns -1. Every element present in the sorted list should be
        found at its index.
        """,
      {"search.py": """
        def binary_search(xs, target):
            lo, hi = 0, len(xs) - 1
            while lo < hi:
                mid = (lo + hi) // 2
                if xs[mid] == target:
                    return mid
                if xs[mid] < target:
                    lo = mid + 1
                else:
                    hi = mid - 1
            return -1
        """,
       "tests/test_search.py": """
        from search import binary_search


        def test_found_middle():
            assert binary_search([1, 3, 5, 7, 9], 5) == 2


        def test_missing():
            assert binary_search([1, 3], 2) == -1
        """},
      [("search.py", "    while lo < hi:", "    while lo <= hi:")],
      {"tests/test_search_issue.py": """
        from search import binary_search


        def test_last():
            assert binary_search([1, 3, 5, 7], 7) == 3


        def test_every_index():
            xs = list(range(0, 40, 3))
            assert [binary_search(xs, x) for x in xs] == list(range(len(xs)))


        def test_empty():
            assert binary_search([], 1) == -1
        """}),

    T("version-compare-numeric", """
        compare_versions says 1.10 < 1.9

        Versions are compared as strings. `compare_versions("1.10", "1.9")` should be `1` (newer), and
        `"1.0"` equals `"1"` (missing parts count as zero).
        """,
      {"versions.py": """
        def compare_versions(a, b):
            \"\"\"-1 if a < b, 0 if equal, 1 if a > b.\"\"\"
            pa, pb = a.split("."), b.split(".")
            return (pa > pb) - (pa < pb)


        def latest(versions):
            best = versions[0]
            for v in versions[1:]:
                if compare_versions(v, best) > 0:
                    best = v
            return best
        """,
       "tests/test_versions.py": """
        from versions import compare_versions


        def test_simple():
            assert compare_versions("1.2", "1.3") == -1
            assert compare_versions("2.0", "2.0") == 0
        """},
      [("versions.py", '    pa, pb = a.split("."), b.split(".")',
        """
            pa, pb = [int(x) for x in a.split(".")], [int(x) for x in b.split(".")]
            n = max(len(pa), len(pb))
            pa, pb = pa + [0] * (n - len(pa)), pb + [0] * (n - len(pb))
        """)],
      {"tests/test_versions_issue.py": """
        from versions import compare_versions, latest


        def test_numeric():
            assert compare_versions("1.10", "1.9") == 1


        def test_padding():
            assert compare_versions("1.0", "1") == 0


        def test_latest():
            assert latest(["1.9", "1.10", "1.2"]) == "1.10"
        """}),

]
