"""Built-in SWE tasks 17-23 (rl/envs/swe/data/builtin_tasks.py explains the format and joins them
in order; split from it by size: task data, one task after another)."""
from __future__ import annotations

from rl.envs.swe.data.task_source import T

TASKS = [
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
