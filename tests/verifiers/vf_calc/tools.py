"""The calculator's tool server: `python -m vf_calc.tools` serves `calculate` over MCP."""

import ast
import operator

import verifiers.v1 as vf

OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv}


def evaluate(expression: str) -> float:
    def ev(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, (int, float)):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in OPS:
            return OPS[type(node.op)](ev(node.left), ev(node.right))
        raise ValueError(f"not arithmetic: {expression!r}")

    return ev(ast.parse(expression, mode="eval").body)


def show(x: float) -> str:
    return str(int(x)) if float(x).is_integer() else str(x)


class CalcToolset(vf.Toolset[vf.SharedToolsetConfig]):
    TOOL_PREFIX = None  # the tool is advertised as plain `calculate`

    @vf.tool
    async def calculate(self, expression: str) -> str:
        """Evaluate an arithmetic expression with + - * / and parentheses."""
        return show(evaluate(expression))


if __name__ == "__main__":
    CalcToolset.run()
