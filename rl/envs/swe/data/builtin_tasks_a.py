"""Built-in SWE tasks 1-8 (rl/envs/swe/data/builtin_tasks.py explains the format and joins them
in order; split from it by size: task data, one task after another)."""
from __future__ import annotations

from rl.envs.swe.data.task_source import T

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

]
