"""SQL (`sql/<kind>`): a seeded SQLite shop database and a question; the answer is one SELECT query.

Both the reference query and the model's run in the sandbox against the same freshly built database,
read-only (`PRAGMA query_only`, an authorizer that only allows reading, one statement, a time budget);
the host compares the two result sets: as multisets of rows unless the question fixes an order, with
numbers compared by value (2 equals 2.0) and column names ignored.
"""

from __future__ import annotations

import json
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

from tether.envs.code.extract import CodeBlockParser
from tether.envs.episode import Environment
from tether.envs.errors import EnvError
from tether.envs.registry import EnvRegistry
from tether.envs.rubric import format_followed, length_within
from tether.envs.sandboxed import run_trusted_fresh
from tether.envs.scoring import Reward, RewardInput, Rubric
from tether.envs.tasks import ChatRenderer, Problem, Task

CITIES = ["Lagos", "Oslo", "Lyon", "Osaka", "Recife", "Brno", "Quito", "Perth"]
FIRST = ["Ada", "Bruno", "Chen", "Dalia", "Emeka", "Farah", "Goran", "Hana", "Ivo", "Jun", "Kemal", "Lena"]
LAST = ["Okafor", "Moreau", "Tanaka", "Silva", "Novak", "Haddad", "Reyes", "Berg"]
CATEGORIES = ["garden", "kitchen", "office", "toys", "audio", "storage"]
NOUNS = ["lamp", "kettle", "bench", "speaker", "planter", "shelf", "drone", "blender", "clock", "mug"]
MAX_ROWS = 5000  # rows read from the candidate's query; a right answer never has more
QUERY_BUDGET_S = 2.0

SCHEMA = """CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT NOT NULL, city TEXT NOT NULL,
    signup_year INTEGER NOT NULL);
CREATE TABLE products (id INTEGER PRIMARY KEY, name TEXT NOT NULL, category TEXT NOT NULL,
    price_cents INTEGER NOT NULL);
CREATE TABLE orders (id INTEGER PRIMARY KEY, customer_id INTEGER NOT NULL REFERENCES customers(id),
    product_id INTEGER NOT NULL REFERENCES products(id), quantity INTEGER NOT NULL, year INTEGER NOT NULL);
"""

SYSTEM = (
    "You are an expert in SQL. Answer the question with a single SQLite SELECT query over the given "
    "database. " + CodeBlockParser("sql").instructions
)


@dataclass(frozen=True, slots=True)
class Shop:
    customers: list[tuple[int, str, str, int]]
    products: list[tuple[int, str, str, int]]
    orders: list[tuple[int, int, int, int, int]]

    def script(self) -> str:
        """The schema and every row, as one SQL script (values are generated here, never user text)."""

        def rows(table: str, items: list[tuple[Any, ...]]) -> str:
            values = ",\n".join("(" + ", ".join(_sql_literal(v) for v in item) + ")" for item in items)
            return f"INSERT INTO {table} VALUES\n{values};\n"

        return (
            SCHEMA
            + rows("customers", self.customers)
            + rows("products", self.products)
            + rows("orders", self.orders)
        )


def _sql_literal(value: Any) -> str:
    return "'" + value.replace("'", "''") + "'" if isinstance(value, str) else str(int(value))


def make_shop(rng: random.Random) -> Shop:
    names = rng.sample([f"{f} {last}" for f in FIRST for last in LAST], rng.randint(24, 40))
    customers = [(i + 1, name, rng.choice(CITIES), rng.randint(2015, 2024)) for i, name in enumerate(names)]
    product_names = rng.sample([f"{c} {n}" for c in CATEGORIES for n in NOUNS], rng.randint(14, 22))
    products = [
        (i + 1, name, name.split()[0], rng.randrange(300, 20000, 25)) for i, name in enumerate(product_names)
    ]
    orders = [
        (
            i + 1,
            rng.randint(1, len(customers)),
            rng.randint(1, len(products)),
            rng.randint(1, 5),
            rng.randint(2019, 2024),
        )
        for i in range(rng.randint(80, 160))
    ]
    return Shop(customers, products, orders)


@dataclass(frozen=True, slots=True)
class Question:
    text: str
    sql: str
    ordered: bool = False


def q_filter(shop: Shop, rng: random.Random) -> Question:
    # Some customer qualifies, so the answer is never empty (an empty answer would be easy to guess).
    _, _, city, signup = rng.choice(shop.customers)
    year = rng.randint(2015, signup)
    return Question(
        f"List the names of the customers who live in {city} and signed up in {year} or later.",
        f"SELECT name FROM customers WHERE city = '{city}' AND signup_year >= {year}",
    )


def q_join(shop: Shop, rng: random.Random) -> Question:
    customer = shop.customers[rng.choice(shop.orders)[1] - 1][1]
    return Question(
        f"Which products has the customer named '{customer}' ordered? Give each product name once.",
        "SELECT DISTINCT p.name FROM orders o JOIN customers c ON c.id = o.customer_id "
        f"JOIN products p ON p.id = o.product_id WHERE c.name = '{customer}'",
    )


def q_aggregate(shop: Shop, rng: random.Random) -> Question:
    category = rng.choice(shop.products)[2]
    year = rng.choice(shop.orders)[4]
    return Question(
        f"What was the total revenue in cents (quantity times price) of '{category}' products in orders "
        f"from {year}? Answer with one row holding one number.",
        "SELECT COALESCE(SUM(o.quantity * p.price_cents), 0) FROM orders o JOIN products p ON p.id = "
        f"o.product_id WHERE p.category = '{category}' AND o.year = {year}",
    )


def q_group(shop: Shop, rng: random.Random) -> Question:
    year = rng.choice(shop.orders)[4]
    return Question(
        f"For each city, how many distinct customers from that city placed at least one order in {year}? "
        "Return (city, count) rows; leave out cities with none.",
        "SELECT c.city, COUNT(DISTINCT c.id) FROM orders o JOIN customers c ON c.id = o.customer_id "
        f"WHERE o.year = {year} GROUP BY c.city",
    )


def q_top(shop: Shop, rng: random.Random) -> Question:
    k = rng.randint(3, 6)
    return Question(
        f"Which {k} products sold the most units (sum of quantity over all orders)? Return (product name, "
        "units) rows ordered by units, highest first, ties broken by product name in ascending order.",
        "SELECT p.name, SUM(o.quantity) AS units FROM orders o JOIN products p ON p.id = o.product_id "
        f"GROUP BY p.id ORDER BY units DESC, p.name ASC LIMIT {k}",
        ordered=True,
    )


def q_having(shop: Shop, rng: random.Random) -> Question:
    per_customer = Counter(order[1] for order in shop.orders)
    counts = sorted(per_customer.values())
    threshold = min(counts[len(counts) // 2], counts[-1] - 1)  # at least one customer qualifies
    return Question(
        f"List the names of the customers who placed more than {threshold} orders.",
        f"SELECT c.name FROM customers c JOIN orders o ON o.customer_id = c.id GROUP BY c.id "
        f"HAVING COUNT(*) > {threshold}",
    )


def q_never(shop: Shop, rng: random.Random) -> Question:
    city_of = {customer[0]: customer[2] for customer in shop.customers}
    bought: dict[str, set[int]] = {}
    for order in shop.orders:
        bought.setdefault(city_of[order[1]], set()).add(order[2])
    # A city whose customers left some product unbought, so that the answer is not empty.
    cities = sorted({c[2] for c in shop.customers if len(bought.get(c[2], set())) < len(shop.products)})
    city = rng.choice(cities)
    return Question(
        f"List the names of the products that no customer living in {city} has ever ordered.",
        "SELECT name FROM products WHERE id NOT IN (SELECT o.product_id FROM orders o JOIN customers c "
        f"ON c.id = o.customer_id WHERE c.city = '{city}')",
    )


KINDS: dict[str, tuple[Callable[[Shop, random.Random], Question], str]] = {
    "filter": (q_filter, "select rows by two conditions"),
    "join": (q_join, "a three-table join with DISTINCT"),
    "aggregate": (q_aggregate, "a filtered SUM over a join"),
    "groupby": (q_group, "GROUP BY with COUNT(DISTINCT)"),
    "topk": (q_top, "ORDER BY with ties and LIMIT (order matters)"),
    "having": (q_having, "GROUP BY with HAVING"),
    "antijoin": (q_never, "NOT IN over a subquery"),
}

# Runs in the sandbox: both queries on their own fresh copy of the database, read-only.
RUNNER = f"""
import json, sqlite3, sys, time
job = json.loads(sys.stdin.read())
ALLOWED = {{sqlite3.SQLITE_SELECT, sqlite3.SQLITE_READ, sqlite3.SQLITE_FUNCTION}}

def allow_reads(action, *args):
    return sqlite3.SQLITE_OK if action in ALLOWED else sqlite3.SQLITE_DENY

def run(sql):
    con = sqlite3.connect(':memory:')
    con.executescript(job['setup'])
    con.execute('PRAGMA query_only = ON')
    con.set_authorizer(allow_reads)
    deadline = time.monotonic() + {QUERY_BUDGET_S}
    con.set_progress_handler(lambda: time.monotonic() > deadline, 10000)
    try:
        cursor = con.execute(sql)
        if cursor.description is None:
            return {{'error': 'not a query'}}
        rows = cursor.fetchmany({MAX_ROWS} + 1)
    except Exception as error:
        return {{'error': type(error).__name__ + ': ' + str(error)[:300]}}
    if len(rows) > {MAX_ROWS}:
        return {{'error': 'more than {MAX_ROWS} rows'}}
    fix = lambda v: v.hex() if isinstance(v, bytes) else v
    return {{'columns': len(cursor.description), 'rows': [[fix(v) for v in row] for row in rows]}}

report({{'reference': run(job['reference']), 'candidate': run(job['candidate'])}})
"""


def _normal(value: Any) -> Any:
    """Numbers by value (SUM may give 2 where AVG gives 2.0), rounded to absorb float noise."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return value
    return round(float(value), 6)


def same_result(reference: dict[str, Any], candidate: dict[str, Any], ordered: bool) -> bool:
    if "error" in candidate or "error" in reference or candidate["columns"] != reference["columns"]:
        return False
    want = [tuple(_normal(v) for v in row) for row in reference["rows"]]
    got = [tuple(_normal(v) for v in row) for row in candidate["rows"]]
    return want == got if ordered else Counter(want) == Counter(got)


@dataclass(frozen=True, slots=True)
class SqlSource:
    kind: str

    def problem(self, seed: int) -> Problem:
        rng = random.Random(f"sql/{self.kind}:{seed}")
        shop = make_shop(rng)
        question = KINDS[self.kind][0](shop, rng)
        sample = "\n".join(
            f"  {table}: {rows[0]}"
            for table, rows in (("customers", shop.customers), ("products", shop.products))
        )
        prompt = (
            f"SQLite database schema:\n\n```sql\n{SCHEMA}```\n\nExample rows:\n{sample}\n\n"
            f"Question: {question.text}"
        )
        data = {"setup": shop.script(), "ordered": question.ordered}
        return Problem(prompt=prompt, answer=question.sql, data=data)


async def correctness(inp: RewardInput) -> float:
    if inp.parsed.answer is None:
        return 0.0
    job = {"setup": inp.task.data["setup"], "reference": inp.task.reference, "candidate": inp.parsed.answer}
    report = await run_trusted_fresh(inp.ctx, RUNNER, stdin=json.dumps(job))
    if report.data is None:
        return 0.0
    reference, candidate = report.data.get("reference"), report.data.get("candidate")
    if not isinstance(reference, dict) or "error" in reference:
        raise EnvError(f"{inp.task.env} seed {inp.task.seed}: the reference query failed: {reference}")
    if not isinstance(candidate, dict):
        return 0.0
    return 1.0 if same_result(reference, candidate, bool(inp.task.data["ordered"])) else 0.0


def adversarial(task: Task) -> list[str]:
    """Wrong answers: changes, several statements, too many or too few rows or columns, hedging."""
    parser = CodeBlockParser("sql")
    reference = task.reference
    answers = [
        f"DELETE FROM orders; {reference}",
        "DROP TABLE orders",
        f"SELECT *, 1 FROM ({reference})",
        f"SELECT * FROM ({reference}) LIMIT 0",
        "SELECT * FROM customers",
        f"{reference};\nUPDATE customers SET city = 'x'",
    ]
    wrapped = f"```sql\n{reference}\n```\n```sql\nSELECT 1\n```"
    return [parser.format(a) for a in answers] + [wrapped]


def sql_env(kind: str) -> Environment:
    if kind not in KINDS:
        raise EnvError(f"unknown SQL kind {kind!r}; expected one of {', '.join(KINDS)}")
    return Environment(
        name=f"sql/{kind}",
        source=SqlSource(kind),
        renderer=ChatRenderer(SYSTEM),
        parser=CodeBlockParser("sql"),
        rubric=Rubric(
            (
                Reward("correctness", correctness, 0.8, gate=True),
                Reward("format", format_followed, 0.1),
                Reward("length", length_within(1500), 0.1),
            )
        ),
        description=f"SQLite: {KINDS[kind][1]}; both queries run in the sandbox",
        adversarial=adversarial,
    )


def register(registry: EnvRegistry) -> None:
    for kind in KINDS:
        registry.register(f"sql/{kind}", partial(sql_env, kind), source=__name__)
