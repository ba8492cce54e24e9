"""What a reader sees of the built guide, beyond that it loads (test_guide_in_browser.py):

* diagrams readable at 1280 px: no text of a Mermaid diagram rendered smaller than MIN_DIAGRAM_PX,
  no two labels overlapping, no subgraph title over a box;
* expected-output blocks set apart from commands: another look, and no copy button;
* at 800 px, the benchmarks table's last column (the ratio) in view without scrolling sideways.
"""

from __future__ import annotations

import pytest
from guide_pages import mermaid_count, output_count, page_paths

pytestmark = pytest.mark.browser

MIN_DIAGRAM_PX = 12.0  # CSS pixels, after the SVG is scaled to the text column

# Per diagram: the rendered size of every text, and the labels that collide. Two lines of one label
# may touch (glyph boxes exceed the line spacing): a collision is an intersection of more than a
# fifth of the smaller box.
DIAGRAM_TEXT = """() => [...document.querySelectorAll("div.mermaid")].map(d => {
  const svg = d.shadowRoot.querySelector("svg");
  const vb = svg.viewBox.baseVal, box = svg.getBoundingClientRect();
  const scale = vb && vb.width ? box.width / vb.width : 1;
  const texts = [];
  const walker = document.createTreeWalker(svg, NodeFilter.SHOW_TEXT);
  for (let n = walker.nextNode(); n; n = walker.nextNode()) {
    if (!n.textContent.trim() || n.parentElement.closest("style")) continue;
    const range = document.createRange();
    range.selectNodeContents(n);
    const r = range.getBoundingClientRect();
    if (r.width === 0) continue;
    texts.push({text: n.textContent.trim(), px: parseFloat(getComputedStyle(n.parentElement).fontSize) * scale,
                title: !!n.parentElement.closest(".cluster-label"), rect: [r.left, r.top, r.right, r.bottom]});
  }
  const boxes = [...svg.querySelectorAll("g.node")].map(g => {
    const r = g.getBoundingClientRect(); return [r.left, r.top, r.right, r.bottom]; });
  const hit = (a, b) => {
    const w = Math.min(a[2], b[2]) - Math.max(a[0], b[0]), h = Math.min(a[3], b[3]) - Math.max(a[1], b[1]);
    const small = Math.min((a[2] - a[0]) * (a[3] - a[1]), (b[2] - b[0]) * (b[3] - b[1]));
    return w > 0 && h > 0 && w * h > 0.2 * small;
  };
  const overlaps = [];
  for (let i = 0; i < texts.length; i++)
    for (let j = i + 1; j < texts.length; j++)
      if (hit(texts[i].rect, texts[j].rect)) overlaps.push(texts[i].text + " / " + texts[j].text);
  for (const t of texts.filter(t => t.title))
    for (const b of boxes) if (hit(t.rect, b)) overlaps.push(t.text + " / a box");
  return {texts: texts.map(t => [t.text, Math.round(t.px * 10) / 10]), overlaps};
})"""

# Per expected-output block: whether its copy button shows, and its code's background and border.
# Material's copy button: .md-code__button[data-md-type=copy] since 9.7, .md-clipboard before.
COPY = '.md-code__button[data-md-type="copy"], .md-clipboard'
OUTPUT_BLOCKS = """() => {
  const COPY = '""" + COPY + """';
  const look = code => { const s = getComputedStyle(code); return s.backgroundColor + " | " + s.borderLeftStyle; };
  const command = document.querySelector("article div.highlight:not(.wc-output) pre > code");
  return {command: command && look(command),
          outputs: [...document.querySelectorAll("article div.wc-output")].map(d => {
            const button = d.querySelector(COPY);
            return {look: look(d.querySelector("pre > code")),
                    button: !!button && getComputedStyle(button).display !== "none" && button.offsetWidth > 0};
          })};
}"""

LAST_COLUMN = """head => {
  const t = [...document.querySelectorAll("article table")].find(t => t.rows[0].innerText.includes(head));
  if (!t) return null;
  const wrap = (t.closest(".md-typeset__scrollwrap") || t.parentElement).getBoundingClientRect();
  const last = [...t.rows[0].cells].pop().getBoundingClientRect();
  return {right: last.right, visible: Math.min(wrap.right, window.innerWidth)};
}"""


@pytest.mark.parametrize("path", [p for p in page_paths() if mermaid_count(p)])
def test_diagrams_are_readable_at_1280_px(visit, path):
    page = visit(path).page
    page.wait_for_function(f"document.querySelectorAll('div.mermaid').length >= {mermaid_count(path)}",
                           timeout=30_000)
    for i, d in enumerate(page.evaluate(DIAGRAM_TEXT)):
        assert d["texts"], f"diagram {i} has no text"
        small = [t for t in d["texts"] if t[1] < MIN_DIAGRAM_PX]
        assert not small, f"diagram {i}: text under {MIN_DIAGRAM_PX} px at 1280 px: {small[:5]}"
        assert not d["overlaps"], f"diagram {i}: labels overlap: {d['overlaps']}"


@pytest.mark.parametrize("path", [p for p in page_paths() if output_count(p)])
def test_expected_output_looks_apart_from_commands_and_has_no_copy_button(visit, path):
    page = visit(path).page
    page.wait_for_selector(f"article :is({COPY})", state="attached", timeout=30_000)  # material adds them
    seen = page.evaluate(OUTPUT_BLOCKS)
    assert len(seen["outputs"]) == output_count(path), seen
    for block in seen["outputs"]:
        assert not block["button"], "an expected-output block shows a copy button"
        assert seen["command"] is None or block["look"] != seen["command"], seen


def test_the_benchmarks_ratio_column_is_in_view_at_800_px(visit):
    page = visit("benchmarks.html", viewport={"width": 800, "height": 900}).page
    col = page.evaluate(LAST_COLUMN, "Disk / zero_copy")
    assert col, "no table with a Disk / zero_copy column on the benchmarks page"
    assert col["right"] <= col["visible"] + 1, f"the ratio column ends at {col['right']} px, past {col['visible']}"


# The scroll box of the widest table that overflows it, and how its scrollbar is drawn. Headless
# Chromium (Playwright's --hide-scrollbars) lays out no scrollbar at all, so the test reads the CSS that
# draws it: the standard properties, which Chromium applies before any ::-webkit-scrollbar rule.
SCROLLBAR = """() => {
  const boxes = [...document.querySelectorAll(".md-typeset__scrollwrap, .md-typeset .wc-scroll")]
    .filter(b => b.scrollWidth > b.clientWidth + 1);
  if (!boxes.length) return null;
  const b = boxes.reduce((x, y) => (y.scrollWidth > x.scrollWidth ? y : x));
  const css = getComputedStyle(b);
  return {width: css.scrollbarWidth, color: css.scrollbarColor, overflow: css.overflowX,
          columns: b.querySelector("tr").children.length};
}"""


def test_a_wide_table_shows_its_scrollbar(visit):
    """The widest tables (17 and 13 columns) are wider than the text column at 1280 px: their box
    scrolls, with a full-width scrollbar in the text's colours (docs/stylesheets/extra.css), not
    material's thin pale one, so the cut-off columns do not look like the table's end."""
    page = visit("benchmarks.html", viewport={"width": 1280, "height": 900}).page
    box = page.evaluate(SCROLLBAR)
    assert box, "no table on the benchmarks page overflows its box at 1280 px: this test checks nothing"
    assert box["overflow"] == "auto", box
    assert box["width"] == "auto", f"the {box['columns']}-column table's scrollbar is {box['width']}: {box}"
    thumb, track = box["color"].split(") ")[0] + ")", box["color"].split(") ", 1)[-1]
    assert box["color"] != "auto" and "rgba(0, 0, 0, 0)" not in thumb and thumb != track, box
