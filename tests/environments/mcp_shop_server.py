"""A local MCP server for the tests, written with the ``mcp`` Python SDK: a tiny shop. The agent
looks up prices and buys; ``grade`` is the grader's tool (hidden from the agent), which checks
what was bought. ``python mcp_shop_server.py`` serves stdio (one shop per episode);
``python mcp_shop_server.py PORT`` serves streamable HTTP on 127.0.0.1:PORT/mcp."""

from __future__ import annotations

import sys

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError

PRICES = {"apple": 3, "pear": 5, "fig": 11}
server = MCPServer("shop")
cart: list[str] = []


@server.tool()
def price(item: str) -> int:
    """The price of one item, in coins."""
    if item not in PRICES:
        raise ToolError(f"no such item: {item}")
    return PRICES[item]


@server.tool()
def buy(item: str) -> int:
    """Put one item in the cart; returns the cart's total."""
    if item not in PRICES:
        raise ToolError(f"no such item: {item}")
    cart.append(item)
    return sum(PRICES[i] for i in cart)


@server.tool()
def grade(expected_total: int) -> float:
    """The grader's: 1.0 when the cart's total is the expected one."""
    return 1.0 if sum(PRICES[i] for i in cart) == expected_total else 0.0


if __name__ == "__main__":
    if len(sys.argv) > 1:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[1]))
    else:
        server.run("stdio")
