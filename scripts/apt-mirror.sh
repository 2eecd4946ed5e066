# shellcheck shell=bash
# Sourced by build-control-plane.sh and build-images.sh: `debian_mirror` prints the Debian
# mirror this machine's apt is configured with, and fails with a message when there is none.
# The project names no mirror of its own: the builds use the one the machine already trusts.
#
# Read: $APT_ETC/sources.list and $APT_ETC/sources.list.d/*.list (one-line `deb [opts] URI
# suite ...`) and $APT_ETC/sources.list.d/*.sources (deb822 paragraphs: `Types:`, `URIs:`,
# `Enabled:`). APT_ETC defaults to /etc/apt. Taken: the first `deb` URI whose path ends in
# /debian (so not debian-security, not a third-party repository), disabled entries skipped.

debian_mirror() {
  local etc="${APT_ETC:-/etc/apt}" uri
  local -a one_line=() deb822=()
  [[ -f "$etc/sources.list" ]] && one_line+=("$etc/sources.list")
  local file
  for file in "$etc"/sources.list.d/*.list; do [[ -f "$file" ]] && one_line+=("$file"); done
  for file in "$etc"/sources.list.d/*.sources; do [[ -f "$file" ]] && deb822+=("$file"); done
  uri="$(
    {
      if ((${#deb822[@]})); then
        # One paragraph per source; a blank line ends it. Field names are case-insensitive.
        awk '
          function flush() {
            if (is_deb && enabled) for (i = 1; i <= n; i++) print uris[i]
            is_deb = 0; enabled = 1; n = 0
          }
          BEGIN { enabled = 1 }
          FNR == 1 { flush() }
          /^[[:space:]]*$/ { flush(); next }
          /^[[:space:]]*#/ { next }
          {
            name = tolower($1)
            if (name == "types:") { for (i = 2; i <= NF; i++) if ($i == "deb") is_deb = 1 }
            else if (name == "uris:") { for (i = 2; i <= NF; i++) uris[++n] = $i }
            else if (name == "enabled:") { enabled = (tolower($2) != "no") }
          }
          END { flush() }
        ' "${deb822[@]}"
      fi
      if ((${#one_line[@]})); then
        awk '$1 == "deb" {
               i = 2
               if ($i ~ /^\[/) { while (i <= NF && $i !~ /\]$/) i++; i++ }
               print $i
             }' "${one_line[@]}"
      fi
    } | grep -E '^[a-z+]+://[^[:space:]]+/debian/?$' | head -n1 || true
  )"
  if [[ -z "$uri" ]]; then
    echo "no Debian mirror in this machine's apt configuration ($etc/sources.list," \
      "$etc/sources.list.d/*.list or *.sources): add the mirror you use (a 'deb URI bookworm" \
      "main' line, or a deb822 .sources file with 'Types: deb' and 'URIs: URI') and run again" >&2
    return 1
  fi
  echo "${uri%/}"
}
