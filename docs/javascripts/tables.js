// Code spans without whitespace in tables (flags, paths, keys) must not wrap inside the token, while
// spans with spaces (log messages) may wrap at them; CSS cannot tell the two apart, so mark them.
// document$ is mkdocs-material's page observable (it also fires after instant navigation).
document$.subscribe(function () {
  document.querySelectorAll(".md-typeset table code").forEach(function (code) {
    if (!/\s/.test(code.textContent)) {
      code.classList.add("wc-token");
    }
  });
});
