//! A minimal zip reader: end of central directory (with zip64), central
//! directory entries, local headers. It locates entries' data; it does not
//! inflate or check CRCs (the repository hashes every byte anyway).
//!
//! The central directory is trusted only after it has been cross-checked
//! against every local header (signature, name, method, and sizes when the
//! local header carries them), so a damaged directory is an error rather than
//! a layout with wrong tensor boundaries.

use std::io::{Read, Seek};

use super::{read_at, FormatError};

const LOCAL_SIG: u32 = 0x0403_4b50;
const CENTRAL_SIG: u32 = 0x0201_4b50;
const EOCD_SIG: u32 = 0x0605_4b50;
const ZIP64_LOCATOR_SIG: u32 = 0x0706_4b50;
const ZIP64_EOCD_SIG: u32 = 0x0606_4b50;
const DESCRIPTOR_SIG: u32 = 0x0807_4b50;

const EOCD_LEN: u64 = 22;
const ZIP64_LOCATOR_LEN: u64 = 20;
const ZIP64_EOCD_LEN: u64 = 56;
const CENTRAL_LEN: usize = 46;
const LOCAL_LEN: u64 = 30;
/// What the entries read from a central directory may take in memory
/// (each entry's struct, its name and [`NAME_OVERHEAD`]), counted as they
/// are read: about three million entries of torch's names. Past it the archive is [`FormatError::TooLarge`]
/// (a torch file is then stored opaque, as for a pickle over its budget).
const ENTRIES_BUDGET: u64 = 256 << 20;

/// What the allocator takes beside a name's bytes.
const NAME_OVERHEAD: u64 = 16;

/// Central directory bytes read at a time (an entry longer than this is
/// read whole: at most 46 + 3 * 65535 bytes).
const CD_WINDOW: u64 = 1 << 20;

/// Compression method of a STORED entry.
pub const STORED: u16 = 0;

/// One entry, after cross-checking its central and local headers.
#[derive(Debug, Clone)]
pub struct Entry {
    pub name: String,
    pub method: u16,
    /// General purpose flags (bit 0: encrypted).
    pub flags: u16,
    /// Offset of the local header.
    pub header_offset: u64,
    /// Offset of the first data byte (after the local header).
    pub data_offset: u64,
    pub compressed_size: u64,
    pub size: u64,
    pub crc: u32,
}

impl Entry {
    /// True when the data bytes in the file are the entry's content.
    pub fn is_plain(&self) -> bool {
        self.method == STORED && self.flags & 1 == 0 && self.compressed_size == self.size
    }
}

/// A parsed archive: its entries in central-directory order.
#[derive(Debug)]
pub struct Archive {
    pub entries: Vec<Entry>,
}

/// True when the file starts with a local header or an empty archive's end
/// record, i.e. it claims to be a zip.
pub fn looks_like_zip<R: Read + Seek>(r: &mut R, len: u64) -> Result<bool, FormatError> {
    if len < 4 {
        return Ok(false);
    }
    let sig = le32(&read_at(r, len, 0, 4, 4, "zip signature")?, 0);
    Ok(sig == LOCAL_SIG || sig == EOCD_SIG)
}

fn le16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

fn le32(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().expect("4 bytes"))
}

fn le64(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().expect("8 bytes"))
}

/// Where the central directory is, from the end records.
struct End {
    entries: u64,
    cd_size: u64,
    cd_offset: u64,
    /// First byte of the end records (zip64 record if any, else EOCD).
    records_start: u64,
}

fn find_end<R: Read + Seek>(r: &mut R, len: u64) -> Result<End, FormatError> {
    if len < EOCD_LEN {
        return Err(FormatError::Truncated {
            what: "zip end of central directory",
            need: EOCD_LEN,
            have: len,
        });
    }
    let tail_len = len.min(EOCD_LEN + u64::from(u16::MAX));
    let tail_start = len - tail_len;
    let tail = read_at(r, len, tail_start, tail_len, tail_len, "zip tail")?;
    // The last signature whose comment length reaches exactly the file end.
    let eocd_at = (0..=tail.len() - EOCD_LEN as usize)
        .rev()
        .find(|&i| {
            le32(&tail, i) == EOCD_SIG
                && i + EOCD_LEN as usize + le16(&tail, i + 20) as usize == tail.len()
        })
        .ok_or_else(|| FormatError::corrupt(len, "no zip end of central directory record"))?;
    let e = &tail[eocd_at..];
    let eocd_pos = tail_start + eocd_at as u64;
    if le16(e, 4) != 0 || le16(e, 6) != 0 {
        return Err(FormatError::corrupt(
            eocd_pos,
            "multi-disk zip archives are not supported",
        ));
    }
    let mut end = End {
        entries: u64::from(le16(e, 10)),
        cd_size: u64::from(le32(e, 12)),
        cd_offset: u64::from(le32(e, 16)),
        records_start: eocd_pos,
    };
    if le16(e, 8) != le16(e, 10) {
        return Err(FormatError::corrupt(eocd_pos, "entry counts disagree"));
    }
    // torch always writes zip64 records; other writers only when a field
    // overflows. Use the locator whenever it is there.
    let has_locator = eocd_at >= ZIP64_LOCATOR_LEN as usize
        && le32(&tail, eocd_at - ZIP64_LOCATOR_LEN as usize) == ZIP64_LOCATOR_SIG;
    let overflow =
        end.entries == 0xFFFF || end.cd_size == 0xFFFF_FFFF || end.cd_offset == 0xFFFF_FFFF;
    if has_locator {
        let loc_pos = eocd_pos - ZIP64_LOCATOR_LEN;
        let loc = &tail[eocd_at - ZIP64_LOCATOR_LEN as usize..eocd_at];
        let rec_pos = le64(loc, 8);
        if rec_pos
            .checked_add(ZIP64_EOCD_LEN)
            .is_none_or(|e| e > loc_pos)
        {
            return Err(FormatError::corrupt(
                loc_pos,
                "zip64 locator points past itself",
            ));
        }
        let rec = read_at(
            r,
            len,
            rec_pos,
            ZIP64_EOCD_LEN,
            ZIP64_EOCD_LEN,
            "zip64 end record",
        )?;
        if le32(&rec, 0) != ZIP64_EOCD_SIG {
            return Err(FormatError::corrupt(
                rec_pos,
                "bad zip64 end record signature",
            ));
        }
        let z = End {
            entries: le64(&rec, 32),
            cd_size: le64(&rec, 40),
            cd_offset: le64(&rec, 48),
            records_start: rec_pos,
        };
        if le64(&rec, 24) != z.entries {
            return Err(FormatError::corrupt(rec_pos, "zip64 entry counts disagree"));
        }
        let agrees = |small: u64, big: u64, sentinel: u64| small == sentinel || small == big;
        if !agrees(end.entries, z.entries, 0xFFFF)
            || !agrees(end.cd_size, z.cd_size, 0xFFFF_FFFF)
            || !agrees(end.cd_offset, z.cd_offset, 0xFFFF_FFFF)
        {
            return Err(FormatError::corrupt(
                rec_pos,
                "zip64 end record disagrees with the end record",
            ));
        }
        end = z;
    } else if overflow {
        return Err(FormatError::corrupt(eocd_pos, "zip64 end record missing"));
    }
    if end.cd_offset.checked_add(end.cd_size) != Some(end.records_start) {
        return Err(FormatError::corrupt(
            end.records_start,
            format!(
                "central directory ({} bytes at {}) does not end where the end records start",
                end.cd_size, end.cd_offset
            ),
        ));
    }
    Ok(end)
}

/// Where the zip archive that ends exactly at `end` starts, for archives
/// written one after another into one file (PyTorch's distributed
/// checkpoint writes one `torch.save` archive per item this way). The
/// offsets inside an archive are relative to its own start, so the start is
/// where the end records say the central directory begins, less that
/// offset. The zip64 end record must sit right before its locator (where
/// every writer puts it), since the locator's pointer is relative too.
pub fn archive_start<R: Read + Seek>(r: &mut R, end: u64) -> Result<u64, FormatError> {
    if end < EOCD_LEN {
        return Err(FormatError::Truncated {
            what: "zip end of central directory",
            need: EOCD_LEN,
            have: end,
        });
    }
    let e = read_at(r, end, end - EOCD_LEN, EOCD_LEN, EOCD_LEN, "zip end record")?;
    let eocd_pos = end - EOCD_LEN;
    if le32(&e, 0) != EOCD_SIG || le16(&e, 20) != 0 {
        return Err(FormatError::corrupt(
            eocd_pos,
            "no zip end record (without comment) at the end of the archive",
        ));
    }
    let (mut cd_size, mut cd_offset, mut records_start) =
        (u64::from(le32(&e, 12)), u64::from(le32(&e, 16)), eocd_pos);
    if eocd_pos >= ZIP64_LOCATOR_LEN + ZIP64_EOCD_LEN {
        let loc_pos = eocd_pos - ZIP64_LOCATOR_LEN;
        let loc = read_at(
            r,
            end,
            loc_pos,
            ZIP64_LOCATOR_LEN,
            ZIP64_LOCATOR_LEN,
            "zip64 locator",
        )?;
        if le32(&loc, 0) == ZIP64_LOCATOR_SIG {
            let rec_pos = loc_pos - ZIP64_EOCD_LEN;
            let rec = read_at(
                r,
                end,
                rec_pos,
                ZIP64_EOCD_LEN,
                ZIP64_EOCD_LEN,
                "zip64 end record",
            )?;
            if le32(&rec, 0) != ZIP64_EOCD_SIG || le64(&rec, 4) != ZIP64_EOCD_LEN - 12 {
                return Err(FormatError::corrupt(
                    rec_pos,
                    "no zip64 end record right before its locator",
                ));
            }
            cd_size = le64(&rec, 40);
            cd_offset = le64(&rec, 48);
            records_start = rec_pos;
            let start = records_start
                .checked_sub(cd_size)
                .and_then(|s| s.checked_sub(cd_offset));
            if start.and_then(|s| s.checked_add(le64(&loc, 8))) != Some(rec_pos) {
                return Err(FormatError::corrupt(
                    loc_pos,
                    "zip64 locator disagrees with the end record's position",
                ));
            }
        }
    }
    records_start
        .checked_sub(cd_size)
        .and_then(|s| s.checked_sub(cd_offset))
        .ok_or_else(|| {
            FormatError::corrupt(
                records_start,
                "central directory offset points before the start of the file",
            )
        })
}

/// Reads the central directory and every local header.
pub fn read_archive<R: Read + Seek>(r: &mut R, len: u64) -> Result<Archive, FormatError> {
    read_archive_within(r, len, ENTRIES_BUDGET, CD_WINDOW)
}

/// [`read_archive`] with the entries' memory `budget` and the central
/// directory read `window` bytes at a time.
fn read_archive_within<R: Read + Seek>(
    r: &mut R,
    len: u64,
    budget: u64,
    window: u64,
) -> Result<Archive, FormatError> {
    let end = find_end(r, len)?;
    if end.entries > end.cd_size / CENTRAL_LEN as u64 {
        return Err(FormatError::corrupt(
            end.cd_offset,
            format!(
                "{} entries cannot fit in {} bytes",
                end.entries, end.cd_size
            ),
        ));
    }
    let too_large = |size: u64| FormatError::TooLarge {
        what: "zip entries",
        size,
        limit: budget,
    };
    // Every entry takes its struct at least: past the budget by count or
    // as names are read, entries are no longer kept, but still read and
    // checked, so a damaged directory stays corrupt (memory: a window).
    let entry_cost = std::mem::size_of::<Entry>() as u64;
    let mut used = end.entries.saturating_mul(entry_cost);
    let mut cd = Window {
        offset: end.cd_offset,
        size: end.cd_size,
        window,
        at: 0,
        buf: Vec::new(),
    };
    let mut entries = Vec::with_capacity(if used > budget {
        0
    } else {
        end.entries as usize
    });
    let mut pos = 0u64;
    for _ in 0..end.entries {
        let at = end.cd_offset + pos;
        let bad = |reason: &str| FormatError::corrupt(at, format!("central directory: {reason}"));
        let h = cd
            .get(r, len, pos, CENTRAL_LEN as u64)?
            .ok_or_else(|| bad("entry runs past its end"))?;
        if le32(h, 0) != CENTRAL_SIG {
            return Err(bad("bad entry signature"));
        }
        let (n, x, c) = (
            le16(h, 28) as usize,
            le16(h, 30) as usize,
            le16(h, 32) as usize,
        );
        let mut size = u64::from(le32(h, 24));
        let mut csize = u64::from(le32(h, 20));
        let mut header_offset = u64::from(le32(h, 42));
        let (method, flags, crc) = (le16(h, 10), le16(h, 8), le32(h, 16));
        let var = cd
            .get(r, len, pos + CENTRAL_LEN as u64, (n + x + c) as u64)?
            .ok_or_else(|| bad("entry runs past its end"))?;
        let name_bytes = &var[..n];
        let extra = &var[n..n + x];
        apply_zip64(extra, &mut size, &mut csize, Some(&mut header_offset)).map_err(&bad)?;
        let name = String::from_utf8_lossy(name_bytes).into_owned();
        used = used.saturating_add(name.len() as u64 + NAME_OVERHEAD);
        if method == STORED && csize != size {
            return Err(bad(
                "STORED entry with different compressed and plain sizes",
            ));
        }
        let entry = check_local(
            r,
            len,
            end.cd_offset,
            name_bytes,
            Entry {
                name,
                method,
                flags,
                header_offset,
                data_offset: 0,
                compressed_size: csize,
                size,
                crc,
            },
        )?;
        if used <= budget {
            entries.push(entry);
        }
        pos += (CENTRAL_LEN + n + x + c) as u64;
    }
    if pos != end.cd_size {
        return Err(FormatError::corrupt(
            end.cd_offset + pos,
            "central directory has bytes after its last entry",
        ));
    }
    if used > budget {
        return Err(too_large(used));
    }
    // Entries may not share bytes: a layout cannot cut one byte range twice.
    let mut by_offset: Vec<&Entry> = entries.iter().collect();
    by_offset.sort_by_key(|e| e.header_offset);
    for w in by_offset.windows(2) {
        if w[0].data_offset + w[0].compressed_size > w[1].header_offset {
            return Err(FormatError::corrupt(
                w[1].header_offset,
                format!("zip entries {:?} and {:?} overlap", w[0].name, w[1].name),
            ));
        }
    }
    Ok(Archive { entries })
}

/// The central directory (`size` bytes at `offset`), read a window at a
/// time: `buf` holds its bytes from `at` on.
struct Window {
    offset: u64,
    size: u64,
    window: u64,
    at: u64,
    buf: Vec<u8>,
}

impl Window {
    /// The directory's bytes `pos..pos + n`, or None past its end.
    fn get<R: Read + Seek>(
        &mut self,
        r: &mut R,
        len: u64,
        pos: u64,
        n: u64,
    ) -> Result<Option<&[u8]>, FormatError> {
        if pos.checked_add(n).is_none_or(|e| e > self.size) {
            return Ok(None);
        }
        if pos < self.at || pos + n > self.at + self.buf.len() as u64 {
            let take = n.max(self.window).min(self.size - pos);
            self.buf = read_at(
                r,
                len,
                self.offset + pos,
                take,
                take,
                "zip central directory",
            )?;
            self.at = pos;
        }
        let from = (pos - self.at) as usize;
        Ok(Some(&self.buf[from..from + n as usize]))
    }
}

/// Replaces 0xFFFFFFFF fields by their values from a zip64 extra field
/// (id 1; values in the order size, compressed size, header offset, present
/// only for the fields that overflowed).
fn apply_zip64(
    mut extra: &[u8],
    size: &mut u64,
    csize: &mut u64,
    header_offset: Option<&mut u64>,
) -> Result<(), &'static str> {
    let mut wanted: Vec<&mut u64> = Vec::with_capacity(3);
    if *size == 0xFFFF_FFFF {
        wanted.push(size);
    }
    if *csize == 0xFFFF_FFFF {
        wanted.push(csize);
    }
    if let Some(o) = header_offset.filter(|o| **o == 0xFFFF_FFFF) {
        wanted.push(o);
    }
    if wanted.is_empty() {
        return Ok(());
    }
    while extra.len() >= 4 {
        let (id, n) = (le16(extra, 0), le16(extra, 2) as usize);
        let body = extra.get(4..4 + n).ok_or("extra field runs past its end")?;
        if id == 1 {
            if body.len() < 8 * wanted.len() {
                return Err("zip64 extra field too short");
            }
            for (i, w) in wanted.into_iter().enumerate() {
                *w = le64(body, 8 * i);
            }
            return Ok(());
        }
        extra = &extra[4 + n..];
    }
    Err("zip64 extra field missing")
}

/// Reads the local header of `e`, checks it against the central directory
/// and fills in the data offset.
fn check_local<R: Read + Seek>(
    r: &mut R,
    len: u64,
    cd_offset: u64,
    cd_name: &[u8],
    mut e: Entry,
) -> Result<Entry, FormatError> {
    let at = e.header_offset;
    let bad =
        |reason: &str| FormatError::corrupt(at, format!("local header of {:?}: {reason}", e.name));
    if at.saturating_add(LOCAL_LEN) > cd_offset {
        return Err(bad("lies inside the central directory"));
    }
    let h = read_at(r, len, at, LOCAL_LEN, LOCAL_LEN, "zip local header")?;
    if le32(&h, 0) != LOCAL_SIG {
        return Err(bad("bad signature"));
    }
    let (n, x) = (u64::from(le16(&h, 26)), u64::from(le16(&h, 28)));
    let var = read_at(r, len, at + LOCAL_LEN, n + x, n + x, "zip local header")?;
    if &var[..n as usize] != cd_name {
        return Err(bad("name differs from the central directory"));
    }
    if le16(&h, 8) != e.method {
        return Err(bad("compression method differs from the central directory"));
    }
    let mut size = u64::from(le32(&h, 22));
    let mut csize = u64::from(le32(&h, 18));
    // With a data descriptor (flag bit 3) the local CRC and sizes may be
    // zero; the descriptor after the data carries them.
    let has_descriptor = le16(&h, 6) & 0x8 != 0;
    let deferred = has_descriptor && size == 0 && csize == 0;
    if !deferred {
        apply_zip64(&var[n as usize..], &mut size, &mut csize, None).map_err(&bad)?;
        if size != e.size || csize != e.compressed_size {
            return Err(bad("sizes differ from the central directory"));
        }
        if le32(&h, 14) != e.crc && !(has_descriptor && le32(&h, 14) == 0) {
            return Err(bad("CRC differs from the central directory"));
        }
    }
    e.data_offset = at + LOCAL_LEN + n + x;
    let data_end = e
        .data_offset
        .checked_add(e.compressed_size)
        .filter(|&end| end <= cd_offset);
    let Some(data_end) = data_end else {
        return Err(bad("data runs into the central directory"));
    };
    if has_descriptor {
        let n = (cd_offset - data_end).min(24);
        let d = read_at(r, len, data_end, n, 24, "zip data descriptor")?;
        if !descriptor_matches(&d, &e) {
            return Err(FormatError::corrupt(
                data_end,
                format!(
                    "data descriptor of {:?} differs from the central directory",
                    e.name
                ),
            ));
        }
    }
    Ok(e)
}

/// A data descriptor: optional signature, CRC, then compressed and plain
/// sizes (4 bytes each, or 8 in zip64 archives).
fn descriptor_matches(mut d: &[u8], e: &Entry) -> bool {
    if d.len() >= 4 && le32(d, 0) == DESCRIPTOR_SIG {
        d = &d[4..];
    }
    if d.len() < 12 || le32(d, 0) != e.crc {
        return false;
    }
    let small = u64::from(le32(d, 4)) == e.compressed_size && u64::from(le32(d, 8)) == e.size;
    let big = d.len() >= 20 && le64(d, 4) == e.compressed_size && le64(d, 12) == e.size;
    small || big
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Cursor;

    /// A zip of stored entries (no zip64), as `torch.save` lays them out:
    /// local headers with their data, the central directory, the end
    /// record.
    fn zip_of(entries: &[(String, Vec<u8>)]) -> Vec<u8> {
        let mut f = Vec::new();
        let mut central = Vec::new();
        for (name, data) in entries {
            let offset = f.len() as u32;
            let sizes = [data.len() as u32; 2].map(u32::to_le_bytes).concat();
            f.extend_from_slice(&LOCAL_SIG.to_le_bytes());
            f.extend_from_slice(&[20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            f.extend_from_slice(&sizes);
            f.extend_from_slice(&(name.len() as u16).to_le_bytes());
            f.extend_from_slice(&[0, 0]);
            f.extend_from_slice(name.as_bytes());
            f.extend_from_slice(data);
            central.extend_from_slice(&CENTRAL_SIG.to_le_bytes());
            central.extend_from_slice(&[20, 0, 20, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
            central.extend_from_slice(&sizes);
            central.extend_from_slice(&(name.len() as u16).to_le_bytes());
            central.extend_from_slice(&[0; 12]);
            central.extend_from_slice(&offset.to_le_bytes());
            central.extend_from_slice(name.as_bytes());
        }
        let cd_offset = f.len() as u32;
        f.extend_from_slice(&central);
        f.extend_from_slice(&EOCD_SIG.to_le_bytes());
        f.extend_from_slice(&[0, 0, 0, 0]);
        f.extend_from_slice(&[(entries.len() as u16).to_le_bytes(); 2].concat());
        f.extend_from_slice(&(central.len() as u32).to_le_bytes());
        f.extend_from_slice(&cd_offset.to_le_bytes());
        f.extend_from_slice(&[0, 0]);
        f
    }

    fn entries(count: usize, name_len: usize) -> Vec<(String, Vec<u8>)> {
        (0..count)
            .map(|i| (format!("archive/data/{i:0name_len$}"), vec![i as u8; i % 5]))
            .collect()
    }

    #[test]
    fn the_central_directory_reads_the_same_through_any_window() {
        let want = entries(300, 4);
        let f = zip_of(&want);
        let len = f.len() as u64;
        for window in [1, 45, 46, 47, 64, 1000, CD_WINDOW] {
            let a = read_archive_within(&mut Cursor::new(&f), len, ENTRIES_BUDGET, window).unwrap();
            let got: Vec<_> = a.entries.iter().map(|e| (e.name.clone(), e.size)).collect();
            let expect: Vec<_> = want
                .iter()
                .map(|(n, d)| (n.clone(), d.len() as u64))
                .collect();
            assert_eq!(got, expect, "window {window}");
            for (e, (_, d)) in a.entries.iter().zip(&want) {
                let at = e.data_offset as usize;
                assert_eq!(&f[at..at + d.len()], d.as_slice());
            }
        }
        // One entry more than the directory holds runs past its end,
        // whatever the window.
        let mut more = f.clone();
        let eocd = more.len() - 22;
        more[eocd + 8..eocd + 12].copy_from_slice(&[[45u8, 1]; 2].concat());
        for window in [7, 46, CD_WINDOW] {
            match read_archive_within(&mut Cursor::new(&more), len, ENTRIES_BUDGET, window) {
                Err(FormatError::Corrupt { reason, .. }) => {
                    assert!(reason.contains("runs past its end"), "{reason}")
                }
                other => panic!("{other:?}"),
            }
        }
    }

    /// A zip of more entries than the budget holds is refused as too large
    /// before its directory is read (by count) or while it is (by names).
    #[test]
    fn zip_entries_past_the_budget_are_too_large() {
        let cost = std::mem::size_of::<Entry>() as u64;
        let many = zip_of(&entries(100, 4));
        let len = many.len() as u64;
        let read = |f: &[u8], budget: u64| {
            read_archive_within(&mut Cursor::new(f), len, budget, CD_WINDOW)
        };
        let names = 100 * (17 + NAME_OVERHEAD);
        assert!(read(&many, 100 * cost + names).is_ok());
        // By count: 100 structs do not fit in 99 (the size said is what
        // they all take, read through).
        match read(&many, 99 * cost) {
            Err(FormatError::TooLarge { size, limit, .. }) => {
                assert_eq!((size, limit), (100 * cost + names, 99 * cost))
            }
            other => panic!("{other:?}"),
        }
        // By names: 100 structs fit, their 17-byte names do not.
        assert!(matches!(
            read(&many, 100 * cost + names - 1),
            Err(FormatError::TooLarge { .. })
        ));
        // A damaged directory within the budget is still corrupt.
        let mut bad = many.clone();
        let cd = le32(&many, many.len() - 22 + 16) as usize;
        bad[cd] ^= 1;
        assert!(matches!(
            read(&bad, ENTRIES_BUDGET),
            Err(FormatError::Corrupt { .. })
        ));
    }

    /// A directory damaged past the budget is corrupt, not a file kept
    /// opaque: the entries over the budget are checked as they are read,
    /// only not kept. By count (the first entry bad) and by names (the
    /// 60th bad, 100 structs fitting) the damage was TooLarge, stored
    /// opaque without an error.
    #[test]
    fn a_damaged_zip_past_the_budget_is_still_corrupt() {
        let cost = std::mem::size_of::<Entry>() as u64;
        let f = zip_of(&entries(100, 4));
        let len = f.len() as u64;
        let cd = le32(&f, f.len() - 22 + 16) as usize;
        let entry_len = CENTRAL_LEN + "archive/data/0000".len();
        for (bad_entry, budget) in [(0, 99 * cost), (59, 100 * cost + 10)] {
            let mut bad = f.clone();
            bad[cd + bad_entry * entry_len] ^= 1;
            for window in [46, CD_WINDOW] {
                match read_archive_within(&mut Cursor::new(&bad), len, budget, window) {
                    Err(FormatError::Corrupt { reason, .. }) => {
                        assert!(reason.contains("bad entry signature"), "{reason}")
                    }
                    other => panic!("entry {bad_entry}, window {window}: {other:?}"),
                }
            }
            // Undamaged, the same directory is too large.
            assert!(matches!(
                read_archive_within(&mut Cursor::new(&f), len, budget, CD_WINDOW),
                Err(FormatError::TooLarge { .. })
            ));
        }
    }

    /// A torch file whose zip64 end record claims 5 million entries (a
    /// 230 MB directory, here a hole in a sparse file) is corrupt from its
    /// first entry, found reading a window of the directory: it was read
    /// whole into memory first.
    #[test]
    fn a_torch_zip_claiming_more_entries_than_the_budget_is_read_a_window_at_a_time() {
        use std::io::Write;
        let entries = 5_000_000u64;
        assert!(entries * std::mem::size_of::<Entry>() as u64 > ENTRIES_BUDGET);
        let cd_offset = LOCAL_LEN;
        let cd_size = entries * CENTRAL_LEN as u64;
        let rec_pos = cd_offset + cd_size;
        let mut tail = ZIP64_EOCD_SIG.to_le_bytes().to_vec();
        tail.extend_from_slice(&44u64.to_le_bytes());
        tail.extend_from_slice(&[45, 0, 45, 0, 0, 0, 0, 0, 0, 0, 0, 0]);
        for v in [entries, entries, cd_size, cd_offset] {
            tail.extend_from_slice(&v.to_le_bytes());
        }
        tail.extend_from_slice(&ZIP64_LOCATOR_SIG.to_le_bytes());
        tail.extend_from_slice(&0u32.to_le_bytes());
        tail.extend_from_slice(&rec_pos.to_le_bytes());
        tail.extend_from_slice(&1u32.to_le_bytes());
        tail.extend_from_slice(&EOCD_SIG.to_le_bytes());
        tail.extend_from_slice(&[0, 0, 0, 0, 0xff, 0xff, 0xff, 0xff]);
        tail.extend_from_slice(&[0xff; 8]);
        tail.extend_from_slice(&[0, 0]);
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("optimizer.pt");
        let mut f = std::fs::File::create(&path).unwrap();
        f.write_all(&LOCAL_SIG.to_le_bytes()).unwrap();
        f.seek(std::io::SeekFrom::Start(rec_pos)).unwrap();
        f.write_all(&tail).unwrap();
        let len = rec_pos + tail.len() as u64;
        let mut f = std::fs::File::open(&path).unwrap();
        match read_archive(&mut f, len) {
            Err(FormatError::Corrupt { offset, reason }) => {
                assert_eq!(offset, cd_offset);
                assert!(reason.contains("bad entry signature"), "{reason}");
            }
            other => panic!("{other:?}"),
        }
        assert!(matches!(
            super::super::parse("optimizer.pt", &mut f, len),
            Err(FormatError::Corrupt { .. })
        ));
    }
}
