// Markdown for replies: marked + highlight.js + KaTeX + mermaid, sanitized with DOMPurify, patched into the page block
// by block so that a streaming reply only touches the blocks that changed (no flicker, selection survives).

const MATH_CACHE = new Map(); // "d|tex" -> KaTeX html: a streaming reply re-parses the same formulas every frame
const MERMAID_CACHE = new Map(); // source -> {svg} | {error}
// key -> diagram source. The source is not put in an attribute: DOMPurify drops attribute values that hold "-->".
const MERMAID_SOURCES = new Map();
let parser = null;
let mathSlots = [];
let finalPass = true;

export function escapeHtml(text) {
  return String(text).replace(/[&<>"']/g, (c) => ({ "&": "&amp;", "<": "&lt;", ">": "&gt;", '"': "&quot;", "'": "&#39;" }[c]));
}

function renderMath(tex, display) {
  const key = `${display ? "d" : "i"}|${tex}`;
  let html = MATH_CACHE.get(key);
  if (html === undefined) {
    try {
      html = window.katex.renderToString(tex, { displayMode: display, throwOnError: false, output: "htmlAndMathml" });
    } catch (err) {
      html = `<code class="math-error" title="${escapeHtml(err.message)}">${escapeHtml(tex)}</code>`;
    }
    if (MATH_CACHE.size > 2000) MATH_CACHE.clear();
    MATH_CACHE.set(key, html);
  }
  // KaTeX's output (MathML included) goes in after DOMPurify: it escapes its input and `trust` is off.
  mathSlots.push(html);
  return `<span data-math="${mathSlots.length - 1}"></span>`;
}

// $$…$$ and \[…\] on their own lines.
const mathBlock = {
  name: "mathBlock",
  level: "block",
  start(src) {
    const m = src.match(/(^|\n) {0,3}(\$\$|\\\[)/);
    return m ? m.index + m[1].length : undefined;
  },
  tokenizer(src) {
    const m = /^ {0,3}(?:\$\$([\s\S]+?)\$\$|\\\[([\s\S]+?)\\\])[ \t]*(?:\n+|$)/.exec(src);
    if (m) return { type: "mathBlock", raw: m[0], text: (m[1] ?? m[2]).trim() };
    return undefined;
  },
  renderer(token) { return `<div class="math-display">${renderMath(token.text, true)}</div>\n`; },
};

// Inline: \(…\), \[…\], $$…$$, and $…$ by pandoc's rule — the opening $ has a non-space on its right, the closing $
// a non-space on its left and no digit after it — so "costs $5 and $10" stays prose.
const mathInline = {
  name: "mathInline",
  level: "inline",
  start(src) {
    const i = src.search(/\$|\\\(|\\\[/);
    return i < 0 ? undefined : i;
  },
  tokenizer(src) {
    let m = /^\$\$([^\n]+?)\$\$/.exec(src) || /^\\\[([\s\S]+?)\\\]/.exec(src);
    if (m) return { type: "mathInline", raw: m[0], text: m[1].trim(), display: true };
    m = /^\\\(([\s\S]+?)\\\)/.exec(src);
    if (m) return { type: "mathInline", raw: m[0], text: m[1].trim(), display: false };
    m = /^\$(?=[^\s$])((?:\\.|[^$\\\n])+?)\$(?!\d)/.exec(src);
    if (m && !/\s$/.test(m[1])) return { type: "mathInline", raw: m[0], text: m[1], display: false };
    return undefined;
  },
  renderer(token) { return renderMath(token.text, token.display); },
};

function fenceClosed(raw) {
  const body = raw.replace(/^[^\n]*\n?/, ""); // drop the opening fence line
  return /(^|\n) {0,3}(`{3,}|~{3,})[ \t]*\n*$/.test(body);
}

function codeBlock(text, lang) {
  let body = escapeHtml(text);
  const hljs = window.hljs;
  if (lang && hljs && hljs.getLanguage(lang)) {
    try { body = hljs.highlight(text, { language: lang, ignoreIllegals: true }).value; } catch { /* plain text */ }
  }
  return `<div class="code-block"><div class="code-head"><span>${escapeHtml(lang || "text")}</span>` +
    `<button type="button" class="btn ghost copy-code" aria-label="Copy code">Copy</button></div>` +
    `<pre><code class="hljs${lang ? ` language-${escapeHtml(lang)}` : ""}">${body}</code></pre></div>\n`;
}

function hashText(text) {
  let hash = 5381; // djb2: only tells diagrams apart within one page
  for (let i = 0; i < text.length; i++) hash = ((hash * 33) ^ text.charCodeAt(i)) >>> 0;
  return `${hash.toString(36)}-${text.length}`;
}

function getParser() {
  if (parser) return parser;
  parser = new window.marked.Marked({ gfm: true, breaks: false });
  parser.use({
    extensions: [mathBlock, mathInline],
    renderer: {
      code(token) {
        const lang = (token.lang || "").trim().split(/\s+/)[0].toLowerCase();
        const text = token.text.replace(/\n$/, "");
        // A diagram renders once its block is complete: half a diagram would flash parse errors mid-stream.
        if (lang === "mermaid" && (finalPass || fenceClosed(token.raw))) {
          const key = hashText(text);
          MERMAID_SOURCES.set(key, text);
          return `<div class="mermaid-pending" data-mermaid="${key}">${codeBlock(text, "mermaid")}</div>\n`;
        }
        return codeBlock(text, lang);
      },
      html(token) { return escapeHtml(token.text); }, // the model's raw HTML is shown, never run
      link(token) {
        const href = escapeHtml(token.href || "");
        return `<a href="${href}" target="_blank" rel="noopener noreferrer">${this.parser.parseInline(token.tokens)}</a>`;
      },
    },
  });
  return parser;
}

/** Markdown to safe HTML. `final` is false while the text is still streaming. */
export function markdownToHtml(text, final = true) {
  finalPass = final;
  mathSlots = [];
  const raw = getParser().parse(text || "");
  const clean = window.DOMPurify.sanitize(raw, { ADD_ATTR: ["target"] });
  const slots = mathSlots;
  return clean.replace(/<span data-math="(\d+)"><\/span>/g, (_, i) => slots[Number(i)] ?? "");
}

/** Split a reply into its reasoning (<think>…</think>) and its answer; `thinking` is true while a block is open. */
export function splitReasoning(content) {
  let reasoning = "";
  let answer = "";
  let rest = content || "";
  let thinking = false;
  if (!rest.includes("<think>") && rest.includes("</think>")) {
    // The chat template opened the block in the prompt; the reply only closes it.
    const end = rest.indexOf("</think>");
    reasoning = rest.slice(0, end);
    rest = rest.slice(end + 8);
  }
  for (;;) {
    const start = rest.indexOf("<think>");
    if (start < 0) { answer += rest; break; }
    answer += rest.slice(0, start);
    const after = rest.slice(start + 7);
    const end = after.indexOf("</think>");
    if (end < 0) { reasoning += after; thinking = true; break; }
    reasoning += `${after.slice(0, end)}\n\n`;
    rest = after.slice(end + 8);
  }
  answer = answer.replace(/<(t(h(i(n(k)?)?)?)?)?$/, ""); // a tag still arriving
  return { reasoning: reasoning.trim(), answer: answer.replace(/^\s+/, ""), thinking };
}

/** Put `text` into `container` as markdown, replacing only the top-level blocks whose HTML changed. */
export function renderMarkdownInto(container, text, final = true) {
  const tpl = document.createElement("template");
  tpl.innerHTML = markdownToHtml(text, final);
  const fresh = [...tpl.content.childNodes].filter((n) => n.nodeType === 1 || n.textContent.trim());
  const old = [...container.childNodes];
  let changed = false;
  fresh.forEach((node, i) => {
    const src = node.nodeType === 1 ? node.outerHTML : node.textContent;
    const current = old[i];
    if (current && current._src === src) return;
    node._src = src;
    if (current) current.replaceWith(node);
    else container.append(node);
    changed = true;
    if (node.nodeType === 1) drawDiagrams(node);
  });
  for (let i = fresh.length; i < old.length; i++) { old[i].remove(); changed = true; }
  return changed;
}

let mermaidLoading = null;
let diagramCount = 0;

function loadMermaid() {
  if (!mermaidLoading) {
    mermaidLoading = new Promise((resolve, reject) => {
      const script = document.createElement("script");
      script.src = "/static/vendor/mermaid.min.js";
      script.onload = () => {
        const dark = matchMedia("(prefers-color-scheme: dark)").matches;
        window.mermaid.initialize({ startOnLoad: false, securityLevel: "strict", theme: dark ? "dark" : "default" });
        resolve(window.mermaid);
      };
      script.onerror = () => reject(new Error("the diagram library did not load"));
      document.head.append(script);
    });
  }
  return mermaidLoading;
}

function showDiagram(el, result) {
  if (result.svg) {
    el.className = "mermaid-diagram";
    el.setAttribute("role", "img");
    el.setAttribute("aria-label", "Diagram");
    el.innerHTML = result.svg;
  } else {
    el.className = "mermaid-failed";
    const note = document.createElement("div");
    note.className = "mermaid-error";
    note.textContent = `Diagram error: ${result.error}`;
    el.prepend(note);
  }
}

function drawDiagrams(root) {
  const pending = root.matches?.(".mermaid-pending") ? [root] : [...root.querySelectorAll(".mermaid-pending")];
  for (const el of pending) {
    const source = MERMAID_SOURCES.get(el.dataset.mermaid);
    if (source === undefined) continue;
    const cached = MERMAID_CACHE.get(source);
    if (cached) { showDiagram(el, cached); continue; }
    el.classList.replace("mermaid-pending", "mermaid-drawing");
    loadMermaid()
      .then(async (mermaid) => {
        const id = `mermaid-${++diagramCount}`;
        try {
          await mermaid.parse(source);
          const { svg } = await mermaid.render(id, source);
          return { svg };
        } catch (err) {
          document.getElementById(id)?.remove();
          document.getElementById(`d${id}`)?.remove();
          return { error: String(err?.message || err).split("\n").slice(0, 3).join("\n") };
        }
      }, (err) => ({ error: err.message }))
      .then((result) => {
        MERMAID_CACHE.set(source, result);
        if (el.isConnected) showDiagram(el, result);
      });
  }
}
