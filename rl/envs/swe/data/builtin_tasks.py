"""The built-in SWE tasks as source: each a tiny repository (`files`, with its visible tests), an issue
text, the fix as (path, old, new) replacements, and the hidden tests as new test files.
`make_builtin.py` turns them into `builtin.jsonl` (diffs computed, test outcomes measured).
"""
from __future__ import annotations

from textwrap import dedent


def _block(s):
    """A fix string: one-line literals are taken as written; a triple-quoted block (starting with a
    newline) is written at file indentation + 8 columns in this source, which is removed here."""
    if not s.startswith("\n"):
        return s
    lines = s[1:].split("\n")
    if any(line.strip() and not line.startswith(" " * 8) for line in lines):
        raise ValueError(f"fix block not indented by 8: {s!r}")
    return "\n".join(line[8:] for line in lines).rstrip()


def T(iid, issue, files, fix, hidden):
    return {"id": iid, "issue": dedent(issue).strip() + "\n",
            "files": {k: dedent(v).lstrip("\n") for k, v in files.items()},
            "fix": [(p, _block(o), _block(n)) for p, o, n in fix],
            "hidden": {k: dedent(v).lstrip("\n") for k, v in hidden.items()}}


TASKS = [
    T("stats-median-even", """
        `median()` is wrong for lists with an even number of elements

        `median([1, 2, 3, 4])` returns `3`; the median of an even-length list is the mean of the two
        middle values, `2.5`.
        """,
      {"stats/__init__.py": "",
       "stats/central.py": """
        def mean(xs):
            if not xs:
                raise ValueError("mean of empty data")
            return sum(xs) / len(xs)


        def median(xs):
            if not xs:
                raise ValueError("median of empty data")
            s = sorted(xs)
            return s[len(s) // 2]
        """,
       "tests/test_central.py": """
        from stats.central import mean, median


        def test_mean():
            assert mean([1, 2, 3]) == 2


        def test_median_odd():
            assert median([3, 1, 2]) == 2
        """},
      [("stats/central.py", "    return s[len(s) // 2]",
        """
            mid = len(s) // 2
            if len(s) % 2:
                return s[mid]
            return (s[mid - 1] + s[mid]) / 2
        """)],
      {"tests/test_central_issue.py": """
        import pytest
        from stats.central import median


        def test_median_even():
            assert median([1, 2, 3, 4]) == 2.5


        def test_median_even_unsorted():
            assert median([10, 0, 4, 6]) == 5


        def test_median_single():
            assert median([7]) == 7


        def test_median_empty():
            with pytest.raises(ValueError):
                median([])
        """}),

    T("paginate-off-by-one", """
        paginate() skips the first page

        Pages are numbered from 1, but `paginate(list(range(10)), page=1, per_page=3)` returns
        `[3, 4, 5]` instead of `[0, 1, 2]`, and the last page is always empty.
        """,
      {"pager.py": """
        def page_count(n_items, per_page):
            return (n_items + per_page - 1) // per_page


        def paginate(items, page, per_page=10):
            \"\"\"Items of 1-based `page`.\"\"\"
            if page < 1:
                raise ValueError("pages start at 1")
            start = page * per_page
            return items[start:start + per_page]
        """,
       "tests/test_pager.py": """
        from pager import page_count


        def test_page_count():
            assert page_count(10, 3) == 4
            assert page_count(9, 3) == 3
        """},
      [("pager.py", "    start = page * per_page", "    start = (page - 1) * per_page")],
      {"tests/test_pager_issue.py": """
        import pytest
        from pager import paginate


        def test_first_page():
            assert paginate(list(range(10)), 1, 3) == [0, 1, 2]


        def test_last_page():
            assert paginate(list(range(10)), 4, 3) == [9]


        def test_page_zero_rejected():
            with pytest.raises(ValueError):
                paginate([1], 0)
        """}),

    T("duration-seconds", """
        parse_duration: support seconds

        `parse_duration("1h30m")` works, but `parse_duration("90s")` and `parse_duration("1m30s")` raise
        `ValueError: bad duration`. Please accept an `s` unit (alone or combined with h and m).
        """,
      {"timeparse.py": """
        import re

        _UNITS = {"h": 3600, "m": 60}
        _PART = re.compile(r"(\\d+)([hm])")


        def parse_duration(text):
            \"\"\"'1h30m' -> 5400 (seconds).\"\"\"
            text = text.strip()
            parts = _PART.findall(text)
            if not parts or "".join(n + u for n, u in parts) != text:
                raise ValueError(f"bad duration: {text!r}")
            return sum(int(n) * _UNITS[u] for n, u in parts)
        """,
       "tests/test_timeparse.py": """
        from timeparse import parse_duration


        def test_hours_minutes():
            assert parse_duration("1h30m") == 5400
        """},
      [("timeparse.py", '_UNITS = {"h": 3600, "m": 60}\n_PART = re.compile(r"(\\d+)([hm])")',
        '_UNITS = {"h": 3600, "m": 60, "s": 1}\n_PART = re.compile(r"(\\d+)([hms])")')],
      {"tests/test_timeparse_issue.py": """
        import pytest
        from timeparse import parse_duration


        def test_seconds():
            assert parse_duration("90s") == 90


        def test_combined():
            assert parse_duration("1h1m1s") == 3661


        def test_minutes():
            assert parse_duration("5m") == 300


        def test_garbage():
            with pytest.raises(ValueError):
                parse_duration("5x")
        """}),

    T("config-get-int-default", """
        Config.get_int ignores its default

        `Config({}).get_int("workers", default=4)` returns `None`; it should return the default when the key
        is missing. Present keys must still be converted to int (`"8"` -> `8`).
        """,
      {"appcfg/__init__.py": "from appcfg.config import Config\n",
       "appcfg/config.py": """
        class Config:
            def __init__(self, values):
                self.values = dict(values)

            def get(self, key, default=None):
                return self.values.get(key, default)

            def get_int(self, key, default=0):
                value = self.values.get(key)
                if value is None:
                    return None
                return int(value)
        """,
       "tests/test_config.py": """
        from appcfg import Config


        def test_get():
            assert Config({"a": "x"}).get("a") == "x"


        def test_get_int_present():
            assert Config({"n": "8"}).get_int("n") == 8
        """},
      [("appcfg/config.py", "            return None\n        return int(value)",
        "            return default\n        return int(value)")],
      {"tests/test_config_issue.py": """
        from appcfg import Config


        def test_get_int_default():
            assert Config({}).get_int("workers", default=4) == 4


        def test_get_int_implicit_default():
            assert Config({}).get_int("workers") == 0


        def test_get_int_converts():
            assert Config({"n": "12"}).get_int("n", default=1) == 12
        """}),

    T("slugify-separators", """
        slugify leaves repeated and trailing dashes

        `slugify("Hello,  World!")` gives `"hello---world-"`. Runs of non-alphanumeric characters should
        become a single `-`, with none at either end: `"hello-world"`.
        """,
      {"textkit/__init__.py": "",
       "textkit/slug.py": """
        import re


        def slugify(text):
            text = text.lower()
            return re.sub(r"[^a-z0-9]", "-", text)
        """,
       "tests/test_slug.py": """
        from textkit.slug import slugify


        def test_simple():
            assert slugify("Hello") == "hello"
        """},
      [("textkit/slug.py", '    return re.sub(r"[^a-z0-9]", "-", text)',
        '    return re.sub(r"[^a-z0-9]+", "-", text).strip("-")')],
      {"tests/test_slug_issue.py": """
        from textkit.slug import slugify


        def test_collapse():
            assert slugify("Hello,  World!") == "hello-world"


        def test_edges():
            assert slugify("  --Big Deal--  ") == "big-deal"


        def test_plain():
            assert slugify("abc123") == "abc123"
        """}),

    T("stack-peek-empty", """
        Stack.peek on an empty stack raises IndexError

        `Stack().pop()` raises `EmptyStackError`, but `Stack().peek()` leaks an `IndexError` from the
        underlying list. peek should raise `EmptyStackError` too.
        """,
      {"containers/__init__.py": "from containers.stack import EmptyStackError, Stack\n",
       "containers/stack.py": """
        class EmptyStackError(Exception):
            pass


        class Stack:
            def __init__(self):
                self._items = []

            def push(self, item):
                self._items.append(item)

            def pop(self):
                if not self._items:
                    raise EmptyStackError("pop from empty stack")
                return self._items.pop()

            def peek(self):
                return self._items[-1]

            def __len__(self):
                return len(self._items)
        """,
       "tests/test_stack.py": """
        from containers import Stack


        def test_push_pop():
            s = Stack()
            s.push(1)
            s.push(2)
            assert s.pop() == 2 and len(s) == 1
        """},
      [("containers/stack.py", "    def peek(self):\n        return self._items[-1]",
        """
            def peek(self):
                if not self._items:
                    raise EmptyStackError("peek at empty stack")
                return self._items[-1]
        """)],
      {"tests/test_stack_issue.py": """
        import pytest
        from containers import EmptyStackError, Stack


        def test_peek_empty():
            with pytest.raises(EmptyStackError):
                Stack().peek()


        def test_peek():
            s = Stack()
            s.push("a")
            assert s.peek() == "a" and len(s) == 1


        def test_pop_empty():
            with pytest.raises(EmptyStackError):
                Stack().pop()
        """}),

    T("csv-quoted-commas", """
        split_row breaks quoted fields that contain commas

        `split_row('a,"b,c",d')` returns `['a', '"b', 'c"', 'd']`; it should honour double quotes and
        return `['a', 'b,c', 'd']`. A doubled quote inside quotes is a literal quote.
        """,
      {"minicsv.py": """
        def split_row(line):
            \"\"\"Split one CSV line into fields.\"\"\"
            return line.rstrip("\\n").split(",")


        def parse(text):
            return [split_row(line) for line in text.splitlines() if line]
        """,
       "tests/test_minicsv.py": """
        from minicsv import parse, split_row


        def test_plain():
            assert split_row("a,b,c") == ["a", "b", "c"]


        def test_parse():
            assert parse("a,b\\nc,d\\n") == [["a", "b"], ["c", "d"]]
        """},
      [("minicsv.py", '    return line.rstrip("\\n").split(",")',
        """
            fields, cur, quoted, i = [], [], False, 0
            line = line.rstrip("\\n")
            while i < len(line):
                ch = line[i]
                if quoted:
                    if ch == '"' and line[i + 1:i + 2] == '"':
                        cur.append('"')
                        i += 1
                    elif ch == '"':
                        quoted = False
                    else:
                        cur.append(ch)
                elif ch == '"':
                    quoted = True
                elif ch == ",":
                    fields.append("".join(cur))
                    cur = []
                else:
                    cur.append(ch)
                i += 1
            fields.append("".join(cur))
            return fields
        """)],
      {"tests/test_minicsv_issue.py": """
        from minicsv import split_row


        def test_quoted_comma():
            assert split_row('a,"b,c",d') == ["a", "b,c", "d"]


        def test_escaped_quote():
            assert split_row('"a ""b"" c",x') == ['a "b" c', "x"]


        def test_empty_fields():
            assert split_row("a,,b") == ["a", "", "b"]
        """}),

    T("roman-subtractive", """
        to_roman does not use subtractive notation

        `to_roman(4)` returns `"IIII"` and `to_roman(1994)` returns `"MDCCCCLXXXXIIII"`. Expected `"IV"` and
        `"MCMXCIV"` (IV, IX, XL, XC, CD, CM).
        """,
      {"numerals.py": """
        _VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]


        def to_roman(n):
            if not 0 < n < 4000:
                raise ValueError("out of range")
            out = []
            for value, sym in _VALUES:
                while n >= value:
                    out.append(sym)
                    n -= value
            return "".join(out)
        """,
       "tests/test_numerals.py": """
        from numerals import to_roman


        def test_simple():
            assert to_roman(3) == "III"
            assert to_roman(2000) == "MM"
        """},
      [("numerals.py",
        '_VALUES = [(1000, "M"), (500, "D"), (100, "C"), (50, "L"), (10, "X"), (5, "V"), (1, "I")]',
        '_VALUES = [(1000, "M"), (900, "CM"), (500, "D"), (400, "CD"), (100, "C"), (90, "XC"), (50, "L"),\n'
        '           (40, "XL"), (10, "X"), (9, "IX"), (5, "V"), (4, "IV"), (1, "I")]')],
      {"tests/test_numerals_issue.py": """
        import pytest
        from numerals import to_roman


        def test_four_nine():
            assert to_roman(4) == "IV" and to_roman(9) == "IX"


        def test_1994():
            assert to_roman(1994) == "MCMXCIV"


        def test_range():
            with pytest.raises(ValueError):
                to_roman(0)
        """}),

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

    T("query-string-decoding", """
        parse_query does not decode values

        `parse_query("q=hello+world&path=%2Fhome")` returns the raw `hello+world` and `%2Fhome`. Values and
        keys should be decoded: `+` is a space and `%XX` a byte (UTF-8). The decoding helper lives in
        `web/encoding.py`.
        """,
      {"web/__init__.py": "",
       "web/encoding.py": """
        def unquote(s):
            \"\"\"Decode a form-encoded component.\"\"\"
            return s
        """,
       "web/query.py": """
        from web.encoding import unquote


        def parse_query(qs):
            out = {}
            for pair in qs.split("&"):
                if not pair:
                    continue
                key, _, value = pair.partition("=")
                out[unquote(key)] = unquote(value)
            return out
        """,
       "tests/test_query.py": """
        from web.query import parse_query


        def test_plain():
            assert parse_query("a=1&b=2") == {"a": "1", "b": "2"}


        def test_empty_value():
            assert parse_query("a=&b") == {"a": "", "b": ""}
        """},
      [("web/encoding.py", "    return s",
        """
            s = s.replace("+", " ")
            out, i = bytearray(), 0
            while i < len(s):
                esc = s[i + 1:i + 3]
                if s[i] == "%" and len(esc) == 2 and all(c in "0123456789abcdefABCDEF" for c in esc):
                    out.append(int(esc, 16))
                    i += 3
                else:
                    out += s[i].encode()
                    i += 1
            return out.decode("utf-8", "replace")
        """)],
      {"tests/test_query_issue.py": """
        from web.encoding import unquote
        from web.query import parse_query


        def test_plus_and_percent():
            assert parse_query("q=hello+world&path=%2Fhome") == {"q": "hello world", "path": "/home"}


        def test_utf8():
            assert unquote("caf%C3%A9") == "café"


        def test_bad_escape_kept():
            assert unquote("100%") == "100%"
        """}),

    T("account-transfer", """
        Add Account.transfer(other, amount)

        We need to move money between accounts. `a.transfer(b, 30)` should withdraw 30 from `a` and
        deposit it in `b`. If `a` lacks the funds it must raise `InsufficientFunds` and change neither
        balance. Amounts must be positive (ValueError otherwise), as for deposit and withdraw.
        """,
      {"bank/__init__.py": "from bank.account import Account, InsufficientFunds\n",
       "bank/account.py": """
        class InsufficientFunds(Exception):
            pass


        class Account:
            def __init__(self, owner, balance=0):
                self.owner = owner
                self.balance = balance

            def deposit(self, amount):
                if amount <= 0:
                    raise ValueError("amount must be positive")
                self.balance += amount

            def withdraw(self, amount):
                if amount <= 0:
                    raise ValueError("amount must be positive")
                if amount > self.balance:
                    raise InsufficientFunds(f"{self.owner}: balance {self.balance} < {amount}")
                self.balance -= amount
        """,
       "tests/test_account.py": """
        import pytest
        from bank import Account, InsufficientFunds


        def test_deposit_withdraw():
            a = Account("ann", 10)
            a.deposit(5)
            a.withdraw(3)
            assert a.balance == 12


        def test_overdraw():
            with pytest.raises(InsufficientFunds):
                Account("ann", 1).withdraw(2)
        """},
      [("bank/account.py",
        "            raise InsufficientFunds(f\"{self.owner}: balance {self.balance} < {amount}\")\n"
                           "        self.balance -= amount",
        """
                    raise InsufficientFunds(f"{self.owner}: balance {self.balance} < {amount}")
                self.balance -= amount

            def transfer(self, other, amount):
                self.withdraw(amount)
                other.deposit(amount)
        """)],
      {"tests/test_account_issue.py": """
        import pytest
        from bank import Account, InsufficientFunds


        def test_transfer():
            a, b = Account("a", 50), Account("b", 5)
            a.transfer(b, 30)
            assert (a.balance, b.balance) == (20, 35)


        def test_transfer_insufficient():
            a, b = Account("a", 10), Account("b", 0)
            with pytest.raises(InsufficientFunds):
                a.transfer(b, 11)
            assert (a.balance, b.balance) == (10, 0)


        def test_transfer_non_positive():
            with pytest.raises(ValueError):
                Account("a", 10).transfer(Account("b"), 0)
        """}),

    T("lru-get-refreshes", """
        LRUCache evicts an entry that was just read

        With capacity 2: put a, put b, get a, put c. `a` was used more recently than `b`, so `b` should be
        evicted, but the cache evicts `a`. Reading an entry should make it most recently used.
        """,
      {"lru.py": """
        from collections import OrderedDict


        class LRUCache:
            def __init__(self, capacity):
                self.capacity = capacity
                self._data = OrderedDict()

            def get(self, key, default=None):
                if key not in self._data:
                    return default
                return self._data[key]

            def put(self, key, value):
                if key in self._data:
                    self._data.move_to_end(key)
                self._data[key] = value
                if len(self._data) > self.capacity:
                    self._data.popitem(last=False)

            def __contains__(self, key):
                return key in self._data
        """,
       "tests/test_lru.py": """
        from lru import LRUCache


        def test_capacity():
            c = LRUCache(2)
            for k in "abc":
                c.put(k, k)
            assert "a" not in c and "c" in c
        """},
      [("lru.py", "            return default\n        return self._data[key]",
        "            return default\n        self._data.move_to_end(key)\n        return self._data[key]")],
      {"tests/test_lru_issue.py": """
        from lru import LRUCache


        def test_get_refreshes():
            c = LRUCache(2)
            c.put("a", 1)
            c.put("b", 2)
            assert c.get("a") == 1
            c.put("c", 3)
            assert "a" in c and "b" not in c


        def test_default():
            assert LRUCache(1).get("x", 5) == 5


        def test_update_refreshes():
            c = LRUCache(2)
            c.put("a", 1)
            c.put("b", 2)
            c.put("a", 3)
            c.put("c", 4)
            assert c.get("a") == 3 and "b" not in c
        """}),

    T("transpose-rectangular", """
        transpose fails on non-square matrices

        `transpose([[1, 2, 3], [4, 5, 6]])` raises IndexError; it should return `[[1, 4], [2, 5], [3, 6]]`.
        """,
      {"matrix.py": """
        def transpose(m):
            n = len(m)
            return [[m[i][j] for i in range(n)] for j in range(n)]


        def matmul(a, b):
            bt = transpose(b)
            return [[sum(x * y for x, y in zip(row, col)) for col in bt] for row in a]
        """,
       "tests/test_matrix.py": """
        from matrix import matmul, transpose


        def test_square():
            assert transpose([[1, 2], [3, 4]]) == [[1, 3], [2, 4]]


        def test_matmul_square():
            assert matmul([[1, 0], [0, 1]], [[5, 6], [7, 8]]) == [[5, 6], [7, 8]]
        """},
      [("matrix.py", "    n = len(m)\n    return [[m[i][j] for i in range(n)] for j in range(n)]",
        "    if not m:\n        return []\n    return [list(col) for col in zip(*m)]")],
      {"tests/test_matrix_issue.py": """
        from matrix import matmul, transpose


        def test_rectangular():
            assert transpose([[1, 2, 3], [4, 5, 6]]) == [[1, 4], [2, 5], [3, 6]]


        def test_matmul_rectangular():
            assert matmul([[1, 2, 3]], [[1], [2], [3]]) == [[14]]


        def test_empty():
            assert transpose([]) == []
        """}),

    T("camel-to-snake-acronyms", """
        camel_to_snake splits acronyms letter by letter

        `camel_to_snake("HTTPServer")` gives `"h_t_t_p_server"`; expected `"http_server"`.
        Likewise `"getHTTPResponseCode"` -> `"get_http_response_code"`. Simple cases such as
        `"camelCase"` -> `"camel_case"` must keep working.
        """,
      {"naming.py": """
        import re


        def camel_to_snake(name):
            return re.sub(r"(?<!^)([A-Z])", r"_\\1", name).lower()


        def snake_to_camel(name):
            first, *rest = name.split("_")
            return first + "".join(w.title() for w in rest)
        """,
       "tests/test_naming.py": """
        from naming import camel_to_snake, snake_to_camel


        def test_simple():
            assert camel_to_snake("camelCase") == "camel_case"


        def test_back():
            assert snake_to_camel("snake_case_name") == "snakeCaseName"
        """},
      [("naming.py", '    return re.sub(r"(?<!^)([A-Z])", r"_\\1", name).lower()',
        """
            s = re.sub(r"([A-Z]+)([A-Z][a-z])", r"\\1_\\2", name)
            return re.sub(r"([a-z0-9])([A-Z])", r"\\1_\\2", s).lower()
        """)],
      {"tests/test_naming_issue.py": """
        from naming import camel_to_snake


        def test_acronym_prefix():
            assert camel_to_snake("HTTPServer") == "http_server"


        def test_acronym_middle():
            assert camel_to_snake("getHTTPResponseCode") == "get_http_response_code"


        def test_pascal():
            assert camel_to_snake("CamelCase") == "camel_case"
        """}),

    T("flatten-deep", """
        flatten only goes one level deep, and explodes strings

        `flatten([1, [2, [3, [4]]]])` returns `[1, 2, [3, [4]]]`; it should flatten any depth:
        `[1, 2, 3, 4]`. Strings are atoms: `flatten(["ab", ["cd"]])` should be `["ab", "cd"]`.
        """,
      {"nested.py": """
        def flatten(items):
            out = []
            for item in items:
                if isinstance(item, (list, tuple)):
                    out.extend(item)
                else:
                    out.append(item)
            return out
        """,
       "tests/test_nested.py": """
        from nested import flatten


        def test_one_level():
            assert flatten([1, [2, 3], (4,)]) == [1, 2, 3, 4]
        """},
      [("nested.py", "            out.extend(item)", "            out.extend(flatten(item))")],
      {"tests/test_nested_issue.py": """
        from nested import flatten


        def test_deep():
            assert flatten([1, [2, [3, [4]]]]) == [1, 2, 3, 4]


        def test_strings_are_atoms():
            assert flatten(["ab", ["cd"]]) == ["ab", "cd"]


        def test_empty_nested():
            assert flatten([[], [[]]]) == []
        """}),

    T("ini-comments", """
        parse_ini treats comments as keys

        Lines starting with `;` or `#` are comments and must be skipped, and so are inline comments
        after ` ;` or ` #` in a value: `port = 8080 ; default` should give `"8080"`. Currently a comment
        line containing `=` becomes a key, and inline comments stay in values.
        """,
      {"inifile/__init__.py": "from inifile.parser import parse_ini\n",
       "inifile/parser.py": """
        def parse_ini(text):
            \"\"\"{section: {key: value}}; keys before any section go to "".\"\"\"
            data = {"": {}}
            section = ""
            for raw in text.splitlines():
                line = raw.strip()
                if not line:
                    continue
                if line.startswith("[") and line.endswith("]"):
                    section = line[1:-1].strip()
                    data.setdefault(section, {})
                    continue
                if "=" in line:
                    key, _, value = line.partition("=")
                    data[section][key.strip()] = value.strip()
            return data
        """,
       "tests/test_parser.py": """
        from inifile import parse_ini


        def test_sections():
            assert parse_ini("a=1\\n[s]\\nb = 2\\n") == {"": {"a": "1"}, "s": {"b": "2"}}
        """},
      [("inifile/parser.py", "        if not line:\n            continue",
        "        if not line or line[0] in \";#\":\n            continue"),
       ("inifile/parser.py", "            data[section][key.strip()] = value.strip()",
        """
                    for marker in (" ;", " #"):
                        if marker in value:
                            value = value[:value.index(marker)]
                    data[section][key.strip()] = value.strip()
        """)],
      {"tests/test_parser_issue.py": """
        from inifile import parse_ini


        def test_comment_lines():
            assert parse_ini("; a = 1\\n# b = 2\\nc = 3\\n") == {"": {"c": "3"}}


        def test_inline_comment():
            assert parse_ini("[srv]\\nport = 8080 ; default\\n")["srv"] == {"port": "8080"}


        def test_hash_in_value():
            assert parse_ini("color=#fff\\n") == {"": {"color": "#fff"}}
        """}),
]
