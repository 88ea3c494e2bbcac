"""Text that tokenizer tests encode with ours and with the reference: prose, code, whitespace,
digits and other numerals, scripts and emoji (each tokenizer test adds its special tokens)."""

from hypothesis import strategies as st

PROSE = [
    "The capital of France is Paris.",
    "Hello, world! How are you doing today? I'm fine; you're kind, we'll see, they've gone, she'd go.",
    "SHOUTING AND MiXeD CaSe, don't WON'T",
    "a",
    "",
    " leading space",
    "trailing space ",
]
CODE = [
    "def add(a, b):\n    return a + b\n",
    "class Node:\n\tdef __init__(self):\n\t\tself.children = []\n\n\n# comment\n",
    'if x == 10:\n    print(f"{x!r:>8}")  # 8 wide\nelse:\n        pass\n',
    "for (int i = 0; i < n; ++i) { sum += a[i] * b[i]; }",
    'x = {"key": [1, 2, 3], "nested": {"y": None}}',
    "    indented = [\n        1,\n        22,\n        333,\n    ]\n",
    "<html>\n  <body class='x'>&nbsp;&lt;tag&gt;</body>\n</html>",
]
WHITESPACE = [
    "   ",
    "\n",
    "\n\n\n",
    "a  b   c    d     e",
    "tabs\t\tand\t \tspaces",
    "line\r\nwindows\r\n",
    " \n \n  \n",
    "end with newline\n",
    "\u00a0non-breaking\u2003em space\u3000ideographic",
]
DIGITS = [
    "12345",
    "3.14159 and 2.71828",
    "Call 555-0199 at 10:30pm on 2024-01-15.",
    "  123",
    "x1y22z333",
    "Fractions ¼ ½ ¾, superscript x² y³, Arabic-Indic ٣٤, Roman Ⅻ, full-width １２",
    "一二三 are CJK numerals but letters (Lo), not digits",
]
UNICODE = [
    "Café naïve résumé façade Ångström",
    "Größe, Straße, Ærøskøbing",
    "日本語のテキストと中文文本和한국어",
    "Привет, мир! Γειά σου Κόσμε! مرحبا بالعالم שלום",
    "emoji 🎉🚀👩‍💻 flags 🇫🇷 skin 👍🏽",
    "math ∀x∈ℝ: x² ≥ 0, ∑ᵢ aᵢ, √2 ≈ 1.414",
    "combining e\u0301 vs é, zero\u200bwidth",
]
TEXTS = PROSE + CODE + WHITESPACE + DIGITS + UNICODE

# Letters, marks, numbers, punctuation, symbols and separators of all scripts Python's Unicode
# database knows (unassigned code points excluded: the Rust side may know newer Unicode).
VARIED_TEXT = st.text(
    alphabet=st.characters(codec="utf-8", exclude_categories=("Cs", "Cn", "Co")), max_size=80
) | st.text(alphabet=" \t\n\r0123456789abcXYZ_.,:;'\"()[]{}<>|é日🎉", max_size=80)
