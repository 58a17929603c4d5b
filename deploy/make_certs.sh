#!/usr/bin/env bash
# Makes the certificates of a shardserve cluster with openssl: a CA, and a key + certificate for
# the coordinator, the workers and a client, all signed by that CA, plus a tokens file that gives
# each certificate identity its roles (rpc/security.h says the format).
#
#   deploy/make_certs.sh DIR [--hosts=DNS_OR_IP,...] [--days=365] [--ca_dir=D]
#
# DIR gets ca.pem (give it as --tls_ca and --tls_client_ca), coordinator.{pem,key},
# worker.{pem,key}, client.{pem,key} and tokens. Server certificates name localhost and
# 127.0.0.1, and every --hosts entry (e.g. the Kubernetes services' DNS names). The coordinator's
# and the workers' certificates serve both as server and as client certificates (they call each
# other). --ca_dir reuses the CA in D (ca.pem, ca.key): what a rotation does, so that peers keep
# trusting the new certificates. Every file changes at one instant (see below), so a process that
# watches DIR never reads half a file or a key and a certificate that do not belong together.
set -euo pipefail

usage() { sed -n '2,13p' "$0" | sed 's/^# \{0,1\}//'; }
[[ $# -ge 1 && $1 != -* ]] || { usage >&2; exit 2; }
dir=$1; shift
hosts="" days=365 ca_dir=""
for arg in "$@"; do
  case "$arg" in
    --hosts=*) hosts=${arg#--hosts=} ;;
    --days=*) days=${arg#--days=} ;;
    --ca_dir=*) ca_dir=${arg#--ca_dir=} ;;
    -h|--help) usage; exit 0 ;;
    *) echo "make_certs.sh: unknown argument $arg" >&2; usage >&2; exit 2 ;;
  esac
done
command -v openssl >/dev/null || { echo "make_certs.sh: openssl is not installed" >&2; exit 1; }
mkdir -p "$dir"
tmp=$(mktemp -d "$dir/.make_certs.XXXXXX")
trap 'rm -rf "$tmp"' EXIT

san="DNS:localhost,IP:127.0.0.1,IP:::1"
IFS=, read -r -a extra <<< "$hosts"
for h in "${extra[@]}"; do
  [[ -n $h ]] || continue
  if [[ $h =~ ^[0-9.]+$ || $h == *:* ]]; then san+=",IP:$h"; else san+=",DNS:$h"; fi
done

if [[ -n $ca_dir ]]; then
  cp "$ca_dir/ca.pem" "$ca_dir/ca.key" "$tmp/"
else
  openssl ecparam -name prime256v1 -genkey -noout -out "$tmp/ca.key" 2>/dev/null
  openssl req -x509 -new -key "$tmp/ca.key" -sha256 -days "$days" -subj "/CN=shardserve-ca" \
    -addext "basicConstraints=critical,CA:TRUE" -addext "keyUsage=critical,keyCertSign,cRLSign" \
    -out "$tmp/ca.pem" 2>/dev/null
fi

# issue NAME CN EXTENDED_KEY_USAGE [SAN]
issue() {
  local name=$1 cn=$2 eku=$3 names=${4:-}
  openssl ecparam -name prime256v1 -genkey -noout -out "$tmp/$name.ec" 2>/dev/null
  openssl pkcs8 -topk8 -nocrypt -in "$tmp/$name.ec" -out "$tmp/$name.key"
  openssl req -new -key "$tmp/$name.key" -subj "/CN=$cn" -out "$tmp/$name.csr" 2>/dev/null
  {
    echo "basicConstraints=critical,CA:FALSE"
    echo "keyUsage=critical,digitalSignature,keyEncipherment"
    echo "extendedKeyUsage=$eku"
    [[ -z $names ]] || echo "subjectAltName=$names"
  } > "$tmp/$name.ext"
  openssl x509 -req -in "$tmp/$name.csr" -CA "$tmp/ca.pem" -CAkey "$tmp/ca.key" \
    -CAcreateserial -days "$days" -sha256 -extfile "$tmp/$name.ext" -out "$tmp/$name.pem" \
    2>/dev/null
}
issue coordinator shardserve-coordinator serverAuth,clientAuth "$san"
issue worker shardserve-worker serverAuth,clientAuth "$san"
issue client shardserve-client clientAuth

# The tokens file is the operator's once it exists: a rotation leaves it alone.
if [[ ! -e $dir/tokens ]]; then
  cat > "$dir/tokens.new" <<'EOF'
# shardserve tokens file: who may call what (rpc/security.h).
#   token SECRET NAME ROLES     a bearer token (sent as "authorization: Bearer SECRET")
#   cert COMMON_NAME ROLES      a client certificate's subject CN (mTLS)
# ROLES: comma-separated of read, write, admin, cluster.
cert shardserve-coordinator cluster
cert shardserve-worker cluster
cert shardserve-client read,write,admin
EOF
  mv -f "$dir/tokens.new" "$dir/tokens"
fi

# Every file changes at one instant, as in a Kubernetes secret volume: the files are links into
# .current, a link to this generation's folder, replaced in one rename. A process that reads a
# key and then its certificate never gets a pair from two generations (gRPC's file watcher reads
# again when a file's time changed while it read).
chmod 600 "$tmp"/*.key
files=(ca.key ca.pem coordinator.key coordinator.pem worker.key worker.pem client.key client.pem)
generation=".gen-$(date +%s%N)"
mkdir "$dir/$generation"
for f in "${files[@]}"; do mv "$tmp/$f" "$dir/$generation/$f"; done
ln -sfn "$generation" "$dir/.current.new"
mv -T "$dir/.current.new" "$dir/.current"
for f in "${files[@]}"; do
  if [[ ! -L $dir/$f ]]; then
    ln -sfn ".current/$f" "$dir/$f.new"
    mv -T "$dir/$f.new" "$dir/$f"
  fi
done
# Keep this generation and the one before it (a reader may still have its files open).
previous=$(ls -1d "$dir"/.gen-* | sort | head -n -2)
[[ -z $previous ]] || rm -rf $previous
echo "certificates for $san in $dir"
